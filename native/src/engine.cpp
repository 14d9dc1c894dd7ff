// The engine's collectives: each allreduce on the first path of a priority list that takes it
// (allreduce_path.hpp), barriers, broadcasts, and the engine's end.
#include "tnt/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "tnt/errors.hpp"
#include "tnt/timeline.hpp"

namespace tnt {
namespace {

// True when a piece's output overlaps its input without being it.
bool overlaps_partly(const Piece& p) {
  const auto in = reinterpret_cast<uintptr_t>(p.in), out = reinterpret_cast<uintptr_t>(p.out);
  return in != out && in < out + p.bytes && out < in + p.bytes;
}

SiteKey site_of(const AllreduceCall& c) {
  return SiteKey{static_cast<int64_t>(c.count), static_cast<int32_t>(c.call.dtype),
                 static_cast<int32_t>(c.call.op), c.call.bucket};
}

double seconds_since(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

size_t bytes_of(const std::vector<Piece>& pieces) {
  size_t bytes = 0;
  for (const auto& p : pieces) bytes += p.bytes;
  return bytes;
}

// When a call recorded in the timeline began (0 while it records nothing).
int64_t timeline_begin() { return timeline::recording() ? timeline::now_ns() : 0; }

}  // namespace

void Engine::check_usable() const {
  if (!usable()) throw AbortedError("the engine is not started, was aborted or closed; rebuild it");
}

AllreducePath* Engine::path_for(const std::vector<AllreducePath*>& paths,
                                const AllreduceCall& call) {
  for (AllreducePath* path : paths)
    if (path->enabled(call)) return path;
  throw std::logic_error("no allreduce path takes this call");
}

void Engine::allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                       const InterruptCheck& interrupt, bool caller_keeps_buffers) {
  const size_t bytes = bytes_of(pieces);
  InCall in(record_, "allreduce", Call{Kind::allreduce, t, op, bucket}, bytes / dtype_size(t),
            bytes);
  const int64_t began = timeline_begin();
  const timeline::Path path = run_allreduce(pieces, t, op, bucket, interrupt, caller_keeps_buffers);
  if (began != 0)
    timeline::record({timeline::kWhole, path, bucket, static_cast<int64_t>(bytes), began,
                      timeline::now_ns()});
}

timeline::Path Engine::run_allreduce(const std::vector<Piece>& pieces, DType t, Op op,
                                     int64_t bucket, const InterruptCheck& interrupt,
                                     bool caller_keeps_buffers) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  check_usable();
  size_t bytes = 0;
  bool overlap = false;
  for (const auto& p : pieces) {
    bytes += p.bytes;
    overlap = overlap || overlaps_partly(p);
  }
  // Such an input would be read after the output overwrote it: reduce a copy of it instead (as
  // numpy's ufuncs do). An output that is its input reduces in place.
  std::vector<std::vector<char>> copies;
  std::vector<Piece> safe;
  if (overlap) {
    safe = pieces;
    for (auto& p : safe)
      if (overlaps_partly(p)) {
        copies.emplace_back(p.in, p.in + p.bytes);
        p.in = copies.back().data();
      }
  }
  const std::vector<Piece>& ps = overlap ? safe : pieces;
  AllreduceCall c;
  c.call = Call{Kind::allreduce, t, op, bucket};
  c.count = bytes / dtype_size(t);
  c.on_pieces = caller_keeps_buffers && !overlap;
  // Where MPI_Allreduce could carry the call as well as our own algorithms, PathChoice picks
  // between them by measurement (and times some calls for that).
  const bool measured = mpi_allreduce_.can_carry(c.count);
  bool timed = false;
  if (measured) c.measured = choice_.next(site_of(c), &timed);
  AllreducePath* path = path_for(whole_paths_, c);
  const timeline::Path taken = path == &mpi_allreduce_ ? timeline::kMpiAllreduce : timeline::kEngine;
  const auto begin = std::chrono::steady_clock::now();
  try {
    path->start(c, ps, interrupt);
    path->finish(c, ps, interrupt);
  } catch (const MismatchError&) {
    if (measured) choice_.reset();  // the ranks' call counts may differ from here on
    throw;
  }
  if (!timed) return taken;
  double medians[2];
  if (!choice_.record(site_of(c), c.measured, seconds_since(begin), medians)) return taken;
  agree_on(medians, interrupt);
  choice_.decide(site_of(c), medians);
  return taken;
}

void Engine::agree_on(double medians[2], const InterruptCheck& interrupt) {
  std::unique_ptr<double[]> v(new double[2]{medians[0], medians[1]});
  try {
    group_->wait_pending(world_mpi_->start_allreduce(v.get(), v.get(), 2, DType::f64, Op::max),
                         "allreduce", world_mpi_->describe_peers(), opt_.timeout_s, interrupt,
                         world_mpi_.get(), true);
  } catch (...) {
    if (group_->abandoned()) (void)v.release();  // MPI may still write it
    throw;
  }
  medians[0] = v[0];
  medians[1] = v[1];
}

bool Engine::overlaps_exchanges() const {
  return usable() && nnodes_ > 1 && choice_.policy() != PathPolicy::engine;
}

int64_t Engine::start_allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                                const InterruptCheck& interrupt) {
  const size_t bytes = bytes_of(pieces);
  InCall in(record_, "allreduce", Call{Kind::allreduce, t, op, bucket}, bytes / dtype_size(t),
            bytes);
  std::lock_guard<std::mutex> lock(call_mutex_);
  check_usable();
  const int64_t began = timeline_begin();
  const auto begin = std::chrono::steady_clock::now();
  if (started_.empty()) batch_ = Batch{};
  AllreduceCall c;
  c.ticket = next_ticket_++;
  c.seq = in.seq();
  c.call = Call{Kind::allreduce, t, op, bucket};
  c.count = bytes / dtype_size(t);
  if (posted_.can_post(c.count, bytes)) {
    if (!batch_.decided) {
      batch_.key = site_of(c);
      batch_.posting = posting_.next(batch_.key, &batch_.timed) == Path::mpi;
      batch_.decided = true;
    }
    c.posting = batch_.posting;
  }
  c.path = path_for(started_paths_, c);
  try {
    c.path->start(c, pieces, interrupt);
  } catch (...) {
    abandon_started(c);
    throw;
  }
  batch_.exposed += seconds_since(begin);
  if (began != 0)
    timeline::record({timeline::kStart, c.posting ? timeline::kPosted : timeline::kEngine, bucket,
                      static_cast<int64_t>(bytes), began, timeline::now_ns()});
  started_.push_back(std::move(c));
  return started_.back().ticket;
}

void Engine::finish_allreduce(int64_t ticket, const std::vector<Piece>& pieces,
                              const InterruptCheck& interrupt) {
  AllreduceCall c;
  {
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (started_.empty() || started_.front().ticket != ticket)
      throw std::invalid_argument(
          "finish_allreduce: allreduces finish in the order of their starts, on the engine that "
          "started them");
    c = std::move(started_.front());
    started_.pop_front();
  }
  const int64_t began = timeline_begin();
  const auto begin = std::chrono::steady_clock::now();
  const size_t bytes = bytes_of(pieces);
  InCall in(record_, "allreduce", c.call, c.count, bytes, c.seq);
  if (bytes != c.count * dtype_size(c.call.dtype)) {
    std::lock_guard<std::mutex> lock(call_mutex_);
    abandon_started(c);
    throw std::invalid_argument("finish_allreduce: the pieces differ in size from the start's");
  }
  c.path->finish(c, pieces, interrupt);
  if (began != 0)
    timeline::record({timeline::kFinish, c.posting ? timeline::kPosted : timeline::kEngine,
                      c.call.bucket, static_cast<int64_t>(bytes), began, timeline::now_ns()});
  std::lock_guard<std::mutex> lock(call_mutex_);
  batch_.exposed += seconds_since(begin);
  if (!started_.empty() || !batch_.timed) return;
  double medians[2];
  if (!posting_.record(batch_.key, batch_.posting ? Path::mpi : Path::engine, batch_.exposed,
                       medians))
    return;
  agree_on(medians, interrupt);
  posting_.decide(batch_.key, medians);
}

void Engine::abandon_started(const AllreduceCall& failed) {
  // What MPI may still write into stays allocated: the engine is rebuilt before the next call.
  broken_ = true;
  bool in_flight = !failed.fragments.empty();
  for (const AllreduceCall& c : started_) in_flight = in_flight || !c.fragments.empty();
  if (in_flight) {
    abandoned_ = true;
    if (world_mpi_) world_mpi_->abandon();
  }
  if (!abandoned()) {  // (no wait was given up: MPI holds none of the stages)
    if (failed.stage) posted_.keep_stage(failed.stage);
    for (const AllreduceCall& c : started_)
      if (c.stage) posted_.keep_stage(c.stage);
  }
  started_.clear();
}

void OwnAlgorithms::finish(AllreduceCall& c, const std::vector<Piece>& pieces,
                           const InterruptCheck& interrupt) {
  e_.group_->run(pieces, c.count, c.call, e_.cross(), e_.opt_.timeout_s, interrupt, c.on_pieces);
}

void WholeAtFinish::finish(AllreduceCall& c, const std::vector<Piece>& pieces,
                           const InterruptCheck& interrupt) {
  e_.run_allreduce(pieces, c.call.dtype, c.call.op, c.call.bucket, interrupt);
}

void Engine::barrier(const InterruptCheck& interrupt) {
  InCall in(record_, "barrier", Call{Kind::barrier, DType::f32, Op::sum, -1}, 0, 0);
  std::lock_guard<std::mutex> lock(call_mutex_);
  check_usable();
  group_->run({}, 0, Call{Kind::barrier, DType::f32, Op::sum, -1}, cross(), opt_.timeout_s,
              interrupt);
}

void Engine::broadcast(std::string& data, int root, const InterruptCheck& interrupt) {
  InCall in(record_, "broadcast", Call{Kind::broadcast, DType::f32, Op::sum, root}, 0, data.size());
  std::lock_guard<std::mutex> lock(call_mutex_);
  check_usable();
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " is not a rank");
  // Agree on the root (and synchronise) first: a mismatch is an error, not a hang.
  group_->run({}, 0, Call{Kind::broadcast, DType::f32, Op::sum, root}, cross(), opt_.timeout_s,
              interrupt);
  if (size_ == 1) return;
  // MPI writes into these buffers; after an abandoned wait it still might: then they leak.
  std::unique_ptr<uint64_t> size(new uint64_t(data.size()));
  std::unique_ptr<std::vector<char>> bytes(new std::vector<char>());
  auto run = [&](void* buf, size_t n) {
    MpiCollectives* w = world_mpi_.get();
    Pending* p = w->start_bcast(buf, n, root);
    group_->wait_pending(p, "broadcast", "rank " + std::to_string(root), opt_.timeout_s,
                         interrupt, w);
  };
  try {
    run(size.get(), sizeof(uint64_t));
    const size_t n = *size;
    if (rank_ == root)
      bytes->assign(data.begin(), data.end());
    else
      bytes->resize(n);
    constexpr size_t kChunk = size_t{1} << 30;
    for (size_t off = 0; off < n; off += kChunk) run(bytes->data() + off, std::min(kChunk, n - off));
    if (rank_ != root) data.assign(bytes->begin(), bytes->end());
  } catch (...) {
    if (group_->abandoned()) {
      (void)size.release();
      (void)bytes.release();
    }
    throw;
  }
}

void Engine::abort(const std::string& why) {
  if (usable()) group_->abort(why);
}

void Engine::close() {
  if (closed_) return;
  closed_ = true;
  if (boot_req_ != MPI_REQUEST_NULL) {  // a suspended bootstrap: MPI may still write its buffers
    abandoned_ = true;
    (void)boot_.release();
  }
  if (group_) group_->close();
  for (const AllreduceCall& s : started_)  // (never finished: MPI may still write their stages)
    abandoned_ = abandoned_ || !s.fragments.empty();
  started_.clear();
  bool dead = broken() || abandoned_;
  if (dead) {
    if (cross_mpi_) cross_mpi_->abandon();
    if (cross_gaspi_) cross_gaspi_->abandon();
    if (world_mpi_) world_mpi_->abandon();
  }
  cross_gaspi_.reset();
  cross_mpi_.reset();
  world_mpi_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!dead && !finalized) {
    if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  const bool in_use = abandoned();
  if (in_use) {
    // A given-up MPI operation may still write into the segment (or the group's buffers): keep
    // them mapped and allocated for the life of the process.
    (void)group_.release();
    seg_.forget();
  }
  mpi_allreduce_.close(in_use);
  posted_.close();
  group_.reset();
  notices_.reset();
  seg_.unlink();
  seg_.unmap();
}

}  // namespace tnt
