// MPI_Allreduce's path: the call as MPI_Allreduce of the world, checked across ranks beside it.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "tnt/engine.hpp"
#include "tnt/errors.hpp"
#include "tnt/reduce.hpp"

namespace tnt {

bool MpiAllreducePath::can_carry(size_t count) const {
  return e_.size_ > 1 && count > 0 && count <= static_cast<size_t>(INT_MAX) &&
         e_.choice_.policy() != PathPolicy::engine;
}

void MpiAllreducePath::finish(AllreduceCall& c, const std::vector<Piece>& pieces,
                              const InterruptCheck& interrupt) {
  Engine& e = e_;
  const size_t count = c.count;
  const Call& call = c.call;
  // On one node its ranks compare their calls through the segment while MPI's exchange starts
  // (their meeting first cost a 4 KB call 0.3-0.4 us of 6). Across nodes every rank's call is
  // checked by an allreduce of its fields (max of them and of their negations), which needs no
  // step of its own inside the node: small calls carry it in front of their data in one
  // message; larger ones start it with the data's allreduce so that both travel at once.
  uint64_t round = 0;
  if (e.nnodes_ == 1)
    round = e.group_->publish_call(call, count, e.opt_.timeout_s, interrupt);
  else
    e.group_->check_not_aborted("allreduce");
  const size_t es = dtype_size(call.dtype), bytes = count * es;
  const bool blob = e.nnodes_ > 1 && bytes <= e.one_message_bytes();
  const bool direct = !blob && c.on_pieces && pieces.size() == 1;
  // The engine's own memory: the check, and unless `direct` a copy of the pieces. (A given-up
  // operation may still use it: then it is leaked.)
  const size_t need = kCheckBytes + (direct ? 0 : bytes);
  if (!stage_) stage_ = new std::vector<char>();
  if (stage_->size() < need) stage_->resize(need);
  char* stage = stage_->data();
  int64_t fields[6];
  call_fields(call.kind, count, call.dtype, call.op, call.bucket, false, fields);
  int64_t* check = reinterpret_cast<int64_t*>(stage);
  fill_call_check(fields, check);
  const void* in = MPI_IN_PLACE;
  char* out = stage + kCheckBytes;
  if (direct) {
    out = pieces[0].out;
    if (pieces[0].in != out) in = pieces[0].in;
  } else {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(out + at, p.in, p.bytes);
      at += p.bytes;
    }
  }
  const std::string peers = e.world_mpi_->describe_peers();
  auto wait = [&](Pending* p, double timeout_s) {
    e.group_->wait_pending(p, "allreduce", peers, timeout_s, interrupt, e.world_mpi_.get(), true);
  };
  int64_t other[5];
  if (blob) {
    wait(e.world_mpi_->start_blob_allreduce(stage, count, call.dtype), e.opt_.timeout_s);
    if (!call_check_result(fields, check, other)) {
      e.broken_ = true;  // (as below: every rank rebuilds, whatever MPI made of unequal blobs)
      throw MismatchError(ranks_disagree(fields, other));
    }
  } else {
    Pending* checked = e.nnodes_ > 1 ? e.world_mpi_->start_allreduce(check, check, kCheckValues,
                                                                 DType::i64, Op::max)
                                   : nullptr;
    const Op op = call.op == Op::average ? Op::sum : call.op;
    Pending* data = nullptr;
    std::string local;
    try {
      data = e.world_mpi_->start_allreduce(in, out, count, call.dtype, op);
      if (e.nnodes_ == 1) local = e.group_->compare_calls(round, data, e.opt_.timeout_s, interrupt);
    } catch (...) {
      e.broken_ = true;  // the node's ranks no longer meet in step (and MPI may still use `data`)
      if (data) {
        e.world_mpi_->abandon();
        e.abandoned_ = true;
      }
      throw;
    }
    if (checked) wait(checked, e.opt_.timeout_s);
    if (e.nnodes_ == 1 ? !local.empty() : !call_check_result(fields, check, other)) {
      // Some ranks made different calls: the data's allreduce may never complete. Every rank
      // sees the same fields, raises, and rebuilds its engine at the next collective.
      e.broken_ = true;
      try {
        wait(data, std::min(e.opt_.timeout_s, 1.0));
      } catch (const CollectiveError&) {
        e.abandoned_ = true;
      }
      throw MismatchError(e.nnodes_ == 1 ? local : ranks_disagree(fields, other));
    }
    wait(data, e.opt_.timeout_s);
  }
  if (e.nnodes_ > 1) e.group_->check_remote_abort("allreduce");  // (see NodeGroup::run)
  if (call.op == Op::average) divide(call.dtype, out, count, e.size_);
  if (!direct) {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(p.out, out + at, p.bytes);
      at += p.bytes;
    }
  }
}

void MpiAllreducePath::close(bool abandoned) {
  if (!abandoned) delete stage_;
  stage_ = nullptr;
}

}  // namespace tnt
