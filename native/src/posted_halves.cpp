// The posted halves of an allreduce across nodes: its start posts the call check and the data as
// messages that move while the caller computes, its finish completes and reduces them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <tuple>

#include "tnt/engine.hpp"
#include "tnt/errors.hpp"
#include "tnt/reduce.hpp"

namespace tnt {
namespace {

// The largest message that MPICH over UCX's TCP sends at once, before the call returns, so that
// the kernel carries it on while nobody polls (2 test hosts at 1 Gbit/s: messages of 30 KiB
// posted around 3 ms of computation left 71 us of 120 KB to move after it, of 31 KiB 822 us).
constexpr size_t kUnattendedBytes = size_t{30} << 10;

}  // namespace

bool PostedHalves::can_post(size_t count, size_t bytes) const {
  return e_.overlaps_exchanges() && count > 0 && bytes <= e_.one_message_bytes();
}

bool PostedHalves::posts_swaps(size_t count, DType dtype) const {
  return e_.nnodes_ == 2 && e_.cfg_.nparts == e_.cfg_.local_size &&
         (e_.cfg_.local_size == 1 || count <= e_.group_->round_elements(dtype_size(dtype)));
}

void PostedHalves::start(AllreduceCall& s, const std::vector<Piece>& pieces,
                         const InterruptCheck& interrupt) {
  Engine& e = e_;
  e.group_->check_not_aborted("allreduce");
  // The call check and the data, in messages that MPICH over UCX's TCP hands to the sockets at
  // once, so they travel while this rank computes. On two nodes of K ranks each, every rank swaps
  // [check | part] with the rank of its local rank on the other node, in messages of at most
  // kUnattendedBytes, the first received into room for any first message (ranks whose calls
  // differ in size still read each other's check), and reduces both parts at the finish: all of
  // it moves unattended, where an MPI_Iallreduce of a fragment sends half (its reduce-scatter) at
  // once and the rest (its allgather) only when polled. With K > 1 the node's ranks first sum the
  // call through the segment (they meet here) and each swaps the part of the sum it reduces in
  // the node group, so that each node sends the call's bytes once, as the engine's own path does;
  // the finish gathers the parts through the segment. Otherwise (more nodes, nodes of different
  // sizes, a call longer than a round) the check goes as an MPI_Iallreduce of MPI's own datatype
  // and op, then one per fragment of at most kFragmentBytes. (One message of check and data, as
  // MPI's path sends it, has a datatype and op of our own, and MPICH's MPI_Iallreduce sends such
  // a call before it returns.)
  const size_t es = dtype_size(s.call.dtype), bytes = s.count * es;
  const int nlocal = e.cfg_.local_size;
  s.swapped = posts_swaps(s.count, s.call.dtype);
  s.hi = s.count;
  if (s.swapped && nlocal > 1) std::tie(s.lo, s.hi) = part_of(s.count, nlocal, e.cfg_.local_rank);
  const size_t part = (s.hi - s.lo) * es;
  const size_t theirs = s.swapped ? std::max(kCheckBytes + part, kUnattendedBytes) : 0;
  s.stage = take_stage(kCheckBytes + bytes + theirs);
  // The stage: [check | the call's data], and where ranks swap, the peer's [check | part] after
  // it; the check goes right in front of this rank's part (over the end of the part before it,
  // which the node's gather takes from another rank).
  char* stage = s.stage->data();
  char* data = stage + kCheckBytes;
  std::exception_ptr node_mismatch;
  int64_t fields[6];
  call_fields(Kind::allreduce, s.count, s.call.dtype, s.call.op, s.call.bucket, false, fields);
  if (s.swapped && nlocal > 1) {
    std::vector<Piece> into;
    size_t at = 0;
    for (const Piece& p : pieces) {
      into.push_back(Piece{p.in, data + at, p.bytes});
      at += p.bytes;
    }
    const Op op = s.call.op == Op::average ? Op::sum : s.call.op;
    try {
      e.group_->run(into, s.count, Call{Kind::allreduce, s.call.dtype, op, s.call.bucket}, nullptr,
                  e.opt_.timeout_s, interrupt, false, true);
    } catch (const MismatchError&) {
      // The swap still goes out, its check saying that this node disagrees, so that the other
      // node raises at its finish; this one raises once it is posted.
      node_mismatch = std::current_exception();
      fields[5] = 1;
    }
  } else {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(data + at, p.in, p.bytes);
      at += p.bytes;
    }
  }
  std::copy(fields, fields + 6, s.fields);
  char* head = data + s.lo * es - kCheckBytes;
  int64_t* check = reinterpret_cast<int64_t*>(head);
  fill_call_check(fields, check);
  if (s.swapped) {
    const int peer = e.cross_mpi_->world_rank(1 - e.cross_mpi_->rank());
    char* received = data + bytes;
    for (size_t off = 0; off < kCheckBytes + part; off += kUnattendedBytes) {
      const size_t n = std::min(kUnattendedBytes, kCheckBytes + part - off);
      s.fragments.push_back(
          e.world_mpi_->start_message(false, received + off, off ? n : kUnattendedBytes, peer));
      s.fragments.push_back(e.world_mpi_->start_message(true, head + off, n, peer));
    }
    if (node_mismatch) std::rethrow_exception(node_mismatch);
    return;
  }
  s.fragments.push_back(e.world_mpi_->start_allreduce(check, check, kCheckValues, DType::i64, Op::max));
  const size_t fragment = kFragmentBytes / es * es;
  const Op op = s.call.op == Op::average ? Op::sum : s.call.op;
  for (size_t off = 0; off < bytes; off += fragment) {
    s.fragments.push_back(e.world_mpi_->start_allreduce(
        data + off, data + off, std::min(fragment, bytes - off) / es, s.call.dtype, op));
  }
}

void PostedHalves::finish(AllreduceCall& s, const std::vector<Piece>& pieces,
                          const InterruptCheck& interrupt) {
  Engine& e = e_;
  std::lock_guard<std::mutex> lock(e.call_mutex_);
  const std::string peers = e.world_mpi_->describe_peers();
  auto wait = [&](double timeout_s) {
    Pending* p = s.fragments.front();
    s.fragments.erase(s.fragments.begin());
    e.group_->wait_pending(p, "allreduce", peers, timeout_s, interrupt, e.world_mpi_.get(), true);
  };
  // The stage as start() left it.
  const size_t es = dtype_size(s.call.dtype);
  char* data = s.stage->data() + kCheckBytes;
  char* mine = data + s.lo * es;
  char* received = data + s.count * es;
  try {
    wait(e.opt_.timeout_s);
    int64_t* check = reinterpret_cast<int64_t*>(mine - kCheckBytes);
    if (s.swapped) {  // (the other rank's check: reduced here as MPI_Iallreduce reduces it)
      int64_t theirs[kCheckValues];
      std::memcpy(theirs, received, sizeof theirs);
      for (int i = 0; i < kCheckValues; ++i) check[i] = std::max(check[i], theirs[i]);
    }
    int64_t other[5];
    if (!call_check_result(s.fields, check, other)) {
      // (as in MpiAllreducePath::finish: every rank sees the same fields, raises and rebuilds)
      e.broken_ = true;
      try {
        while (!s.fragments.empty()) wait(std::min(e.opt_.timeout_s, 1.0));
      } catch (const CollectiveError&) {
      }
      throw MismatchError(other[0] < 0 ? nodes_disagree(s.fields, other)
                                       : ranks_disagree(s.fields, other));
    }
    while (!s.fragments.empty()) wait(e.opt_.timeout_s);
  } catch (...) {
    e.abandon_started(s);
    throw;
  }
  e.group_->check_remote_abort("allreduce");  // (see NodeGroup::run)
  if (s.swapped) {  // (the lower node's part first on both nodes: the same bits on each)
    const void* srcs[2] = {mine, received + kCheckBytes};
    if (e.cross_mpi_->rank() == 1) std::swap(srcs[0], srcs[1]);
    reduce(s.call.dtype, s.call.op, srcs, 2, mine, nullptr, s.hi - s.lo, e.size_);
  } else if (s.call.op == Op::average) {
    divide(s.call.dtype, data, s.count, e.size_);
  }
  std::vector<Piece> from;
  size_t at = 0;
  for (const Piece& p : pieces) {
    from.push_back(Piece{data + at, p.out, p.bytes});
    at += p.bytes;
  }
  if (s.swapped && e.cfg_.local_size > 1) {
    try {  // every part from the rank that reduced it
      e.group_->run(from, s.count, Call{Kind::gather, s.call.dtype, Op::sum, s.call.bucket}, nullptr,
                  e.opt_.timeout_s, interrupt, false, true);
    } catch (...) {
      e.abandon_started(s);
      throw;
    }
  } else {
    for (const Piece& p : from) copy_bytes(p.out, p.in, p.bytes);
  }
  keep_stage(s.stage);
}

std::vector<char>* PostedHalves::take_stage(size_t bytes) {
  auto fit = spare_stages_.lower_bound(bytes);  // the smallest spare large enough
  if (fit != spare_stages_.end()) {
    std::vector<char>* stage = fit->second;
    spare_stages_.erase(fit);
    return stage;
  }
  if (!spare_stages_.empty()) {  // every spare is too small: the largest makes way
    auto largest = std::prev(spare_stages_.end());
    delete largest->second;
    spare_stages_.erase(largest);
  }
  return new std::vector<char>(bytes);
}

void PostedHalves::close() {
  for (auto& spare : spare_stages_) delete spare.second;
  spare_stages_.clear();
}

}  // namespace tnt
