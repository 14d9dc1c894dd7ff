#pragma once
// The ways the engine carries out an allreduce, in Horovod's common/ops shape: each path one
// implementation of AllreducePath, and the engine's choice among them one loop over a priority
// list (Engine::path_for: the first path enabled for a call carries it out).
//   - OwnAlgorithms: the engine's own algorithms (the node group's shared memory inside a node,
//     the transport between nodes); carries out any call.
//   - MpiAllreducePath: MPI_Allreduce of the world, where PathChoice measured it faster.
//   - PostedHalves: a call's start posts it across nodes as messages that move while the caller
//     computes; its finish completes it (Engine::start_allreduce).
//   - WholeAtFinish: a started call that is not posted, carried out whole by its finish through
//     the first two.
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "tnt/call_check.hpp"
#include "tnt/node_group.hpp"
#include "tnt/path_choice.hpp"
#include "tnt/transport.hpp"
#include "tnt/wait.hpp"

namespace tnt {

class Engine;

// One allreduce call, from its start to its finish (or both at once).
struct AllreduceCall {
  int64_t ticket = 0;
  uint64_t seq = 0;  // its number in the engine's CallRecord
  Call call;
  size_t count = 0;
  // The path that PathChoice chose for the call's site (Path::engine where MPI's cannot carry it).
  Path measured = Path::engine;
  // MPI_Allreduce, and the exchange between nodes of a node of one rank, may work on the pieces
  // themselves (the caller keeps them allocated, and no output overlaps its input partly).
  bool on_pieces = false;
  // Started calls: whether its batch posts (see Engine::Batch), and the path it started on.
  bool posting = false;
  class AllreducePath* path = nullptr;
  // Posted as messages to one rank of the other node (their part after ours): elements
  // [lo, hi), the part this rank reduces; on nodes of several ranks, of the node's sum.
  bool swapped = false;
  size_t lo = 0, hi = 0;
  int64_t fields[6] = {};              // the call check's (posted only)
  std::vector<char>* stage = nullptr;  // the check and the data (leaked if abandoned)
  std::vector<Pending*> fragments;     // in flight, the first with the check
};

class AllreducePath {
 public:
  virtual ~AllreducePath() = default;
  // Whether this path carries out `call` (the same answer on every rank).
  virtual bool enabled(const AllreduceCall& call) const = 0;
  // The first half, at the call's start: what can travel while the caller computes. A path that
  // carries a call out whole does nothing here.
  virtual void start(AllreduceCall&, const std::vector<Piece>&, const InterruptCheck&) {}
  // Carries the call out, or completes what start began, and writes the pieces' outputs.
  virtual void finish(AllreduceCall& call, const std::vector<Piece>& pieces,
                      const InterruptCheck& interrupt) = 0;
};

class OwnAlgorithms final : public AllreducePath {
 public:
  explicit OwnAlgorithms(Engine& e) : e_(e) {}
  bool enabled(const AllreduceCall&) const override { return true; }
  void finish(AllreduceCall& call, const std::vector<Piece>& pieces,
              const InterruptCheck& interrupt) override;

 private:
  Engine& e_;
};

class MpiAllreducePath final : public AllreducePath {
 public:
  explicit MpiAllreducePath(Engine& e) : e_(e) {}
  // Whether MPI_Allreduce can carry a call of `count` elements at all (then PathChoice measures
  // it against our own).
  bool can_carry(size_t count) const;
  bool enabled(const AllreduceCall& call) const override {
    return call.measured == Path::mpi && can_carry(call.count);
  }
  void finish(AllreduceCall& call, const std::vector<Piece>& pieces,
              const InterruptCheck& interrupt) override;
  // At the engine's close: frees the stage unless a given-up operation may still use it.
  void close(bool abandoned);

 private:
  Engine& e_;
  std::vector<char>* stage_ = nullptr;  // the check and a copy of the pieces (leaked if abandoned)
};

class PostedHalves final : public AllreducePath {
 public:
  explicit PostedHalves(Engine& e) : e_(e) {}
  // Whether a call of `count` elements, `bytes` in all, may be posted (then the batch's choice
  // decides whether it is).
  bool can_post(size_t count, size_t bytes) const;
  bool enabled(const AllreduceCall& call) const override { return call.posting; }
  void start(AllreduceCall& call, const std::vector<Piece>& pieces,
             const InterruptCheck& interrupt) override;
  void finish(AllreduceCall& call, const std::vector<Piece>& pieces,
              const InterruptCheck& interrupt) override;
  // A stage of a completed call (MPI no longer holds it), for the next ones.
  void keep_stage(std::vector<char>* stage) { spare_stages_.emplace(stage->size(), stage); }
  // At the engine's close: frees the spare stages.
  void close();

 private:
  // Whether calls of `count` x `dtype` are posted as swaps with the other node (see start()).
  bool posts_swaps(size_t count, DType dtype) const;
  // A stage of at least `bytes`: a spare one if one is large enough (a training step posts the
  // same sizes as the step before), else a new one in place of a spare too small. Never more
  // stages than calls were posted at once; written once per call, never zero-filled again.
  std::vector<char>* take_stage(size_t bytes);

  Engine& e_;
  // The stages of completed calls (MPI no longer holds them), by size.
  std::multimap<size_t, std::vector<char>*> spare_stages_;
};

class WholeAtFinish final : public AllreducePath {
 public:
  explicit WholeAtFinish(Engine& e) : e_(e) {}
  bool enabled(const AllreduceCall&) const override { return true; }
  void finish(AllreduceCall& call, const std::vector<Piece>& pieces,
              const InterruptCheck& interrupt) override;

 private:
  Engine& e_;
};

}  // namespace tnt
