// The node group's set-up, its calls' headers in the segment, and the ranks' shared arrays; its
// waits are in node_group_waits.cpp, its collectives in node_group_run.cpp.
#include "tnt/node_group.hpp"

#include <unistd.h>

#include <algorithm>
#include <new>

#include "node_segment.hpp"
#include "tnt/errors.hpp"

namespace tnt {
namespace {

// A header's call check fields.
void fields_of(const Header& h, bool node_disagrees, int64_t fields[6]) {
  const int64_t f[6] = {h.kind, h.count, h.dtype, h.op, h.bucket, node_disagrees ? 1 : 0};
  std::copy(f, f + 6, fields);
}

std::string describe(const Header& h) {
  const int64_t fields[5] = {h.kind, h.count, h.dtype, h.op, h.bucket};
  return describe_call(fields, h.via_mpi != 0);
}

// (Ranks take the same path at the same call; one that did not would otherwise meet the others'
// rounds without its data.)
bool same_call(const Header& a, const Header& b) {
  return a.kind == b.kind && a.count == b.count && a.dtype == b.dtype && a.op == b.op &&
         a.bucket == b.bucket && a.via_mpi == b.via_mpi;
}

}  // namespace

size_t segment_bytes(const NodeConfig& cfg) {
  return data_offset(cfg.local_size) + 2 * half_bytes_of(cfg) * static_cast<size_t>(cfg.local_size);
}

size_t part_bytes(const NodeConfig& cfg) {
  return half_bytes_of(cfg) / static_cast<size_t>(cfg.nparts);
}

std::pair<size_t, size_t> part_of(size_t len, int nparts, int j) {
  const size_t P = static_cast<size_t>(nparts), q = ((len + P - 1) / P + 15) / 16 * 16;
  return {std::min(static_cast<size_t>(j) * q, len), std::min(static_cast<size_t>(j + 1) * q, len)};
}

NodeGroup::NodeGroup(NodeConfig cfg, Segment* seg, bool creator) : cfg_(std::move(cfg)), seg_(seg) {
  char* base = seg_->data();
  hdr_ = reinterpret_cast<SegHeader*>(base);
  ctl_ = reinterpret_cast<RankCtl*>(base + ctl_offset());
  data_ = base + data_offset(cfg_.local_size);
  half_bytes_ = half_bytes_of(cfg_);
  if (creator) {
    new (hdr_) SegHeader();
    for (int i = 0; i < cfg_.local_size; ++i) new (&ctl_[i]) RankCtl();
    hdr_->local_size = static_cast<uint32_t>(cfg_.local_size);
    hdr_->nparts = static_cast<uint32_t>(cfg_.nparts);
    hdr_->half_bytes = half_bytes_;
    std::atomic_thread_fence(std::memory_order_release);
    hdr_->magic = kMagic;
  }
  srcs_.resize(static_cast<size_t>(cfg_.local_size) + 1);
  peer_in_.resize(static_cast<size_t>(cfg_.local_size));
}

NodeGroup::~NodeGroup() {
  for (const auto& [key, base] : peer_blocks_)
    unmap_peer_block(base, static_cast<size_t>(std::get<2>(key)));
}

void NodeGroup::attach() {
  std::atomic_thread_fence(std::memory_order_acquire);
  if (hdr_->magic != kMagic || hdr_->local_size != static_cast<uint32_t>(cfg_.local_size) ||
      hdr_->half_bytes != half_bytes_)
    throw CollectiveError("shared-memory segment " + seg_->name() +
                          " does not match this rank's configuration "
                          "(do all ranks use the same TNT_SHM_SEGMENT_BYTES?)");
  RankCtl& me = ctl_[cfg_.local_rank];
  me.pid = static_cast<int32_t>(getpid());
  me.world_rank = cfg_.world_ranks[cfg_.local_rank];
  me.state.store(kAttached, std::memory_order_release);
}

size_t NodeGroup::round_elements(size_t element_bytes) const {
  const size_t unit = 16 * static_cast<size_t>(cfg_.nparts);
  return std::max(unit, (half_bytes_ / element_bytes) / unit * unit);
}

char* NodeGroup::half(int local, uint64_t round) const {
  return data_ + (static_cast<size_t>(local) * 2 + (round & 1)) * half_bytes_;
}

void NodeGroup::abort(const std::string& why, bool propagate) {
  if (broken_ && !propagate) return;
  const bool first = !broken_;
  broken_ = true;
  RankCtl& me = ctl_[cfg_.local_rank];
  snprintf(me.abort_msg, sizeof me.abort_msg, "%s", why.c_str());
  int32_t expected = -1;  // (the message itself names the aborting rank where it matters)
  hdr_->abort_local.compare_exchange_strong(expected, cfg_.local_rank);
  if (first && propagate && notify_remote_) notify_remote_(why);
}

void NodeGroup::close() {
  if (hdr_) ctl_[cfg_.local_rank].state.store(kClosed, std::memory_order_release);
}

void NodeGroup::finish_round(uint64_t round) {
  RankCtl& me = ctl_[cfg_.local_rank];
  for (auto& c : me.counters) c.v.store(round, std::memory_order_release);
}

char* NodeGroup::peer_array(int local, int64_t fd, int64_t block_bytes, int64_t offset,
                            const Deadline& d) {
  if (fd < 0) return nullptr;
  const auto key = std::make_tuple(local, fd, block_bytes);
  auto it = peer_blocks_.find(key);
  if (it == peer_blocks_.end()) {
    try {
      it = peer_blocks_
               .emplace(key, map_peer_block(ctl_[local].pid, fd, static_cast<size_t>(block_bytes)))
               .first;
    } catch (const std::exception& e) {
      const std::string msg = std::string(d.what) + ": cannot map the shared array of rank " +
                              std::to_string(cfg_.world_ranks[local]) + " (" + e.what() + ")";
      abort(msg);
      throw CollectiveError(msg);
    }
  }
  return it->second + offset;
}

void NodeGroup::map_shared_arrays(uint64_t round, const Deadline& d) {
  const int b = static_cast<int>(round & 1), me = cfg_.local_rank, p = cfg_.local_size;
  for (int j = 0; j < p; ++j) {
    const SharedLoc& in = ctl_[j].hdr[b].in;
    peer_in_[j] = j == me ? nullptr : peer_array(j, in.fd, in.block_bytes, in.offset, d);
  }
  peer_out_ = nullptr;
  // Two ranks: an owner's part has one reader, and its second store can go to that reader's
  // output instead of the segment. (More ranks gather from the segment: each part, stored once
  // there, has several readers.)
  const int other = 1 - me;
  if (p == 2 && cfg_.nparts == 2 && ctl_[me].hdr[b].out.fd >= 0) {
    const SharedLoc& out = ctl_[other].hdr[b].out;
    peer_out_ = peer_array(other, out.fd, out.block_bytes, out.offset, d);
  }
}

std::string NodeGroup::check_headers(uint64_t round) {
  const int b = static_cast<int>(round & 1);
  const Header& mine = ctl_[cfg_.local_rank].hdr[b];
  bool same = true;
  for (int j = 0; j < cfg_.local_size; ++j) same = same && same_call(ctl_[j].hdr[b], mine);
  if (same) return {};
  std::string msg = std::string("ranks called collectives with different arguments: ");
  for (int j = 0; j < cfg_.local_size; ++j) {
    if (j) msg += "; ";
    msg += "rank " + std::to_string(cfg_.world_ranks[j]) + ": " + describe(ctl_[j].hdr[b]);
  }
  return msg;
}

void NodeGroup::fill_cross_check(const Header& h, bool node_disagrees) {
  int64_t fields[6];
  fields_of(h, node_disagrees, fields);
  fill_call_check(fields, cross_hdr_);
}

bool NodeGroup::cross_check_result(const Header& h, bool node_disagrees, int64_t other[5]) const {
  int64_t fields[6];
  fields_of(h, node_disagrees, fields);
  return call_check_result(fields, cross_hdr_, other);
}

bool NodeGroup::cross_check(const Header& h, bool node_disagrees, Transport* cross,
                            const Deadline& d, int64_t other[5]) {
  fill_cross_check(h, node_disagrees);
  wait_pending(cross->start_checked_allreduce(cross_hdr_, nullptr, nullptr, 0, DType::f32, Op::sum),
               d.what, cross->describe_peers(), d.timeout_s, *d.interrupt, cross);
  return cross_check_result(h, node_disagrees, other);
}

uint64_t NodeGroup::publish_call(const Call& call, size_t count, double timeout_s,
                                 const InterruptCheck& interrupt) {
  const char* what = kind_name(call.kind);
  check_not_aborted(what);
  const int me = cfg_.local_rank, p = cfg_.local_size;
  const Deadline d = Deadline::after(timeout_s, interrupt, what);
  try {
    const uint64_t R = ++round_;
    if (R > 2)  // every peer is done with the header of this parity
      for (int j = 0; j < p; ++j)
        if (j != me) wait_counter(j, kGathered, R - 2, d);
    RankCtl& mine = ctl_[me];
    mine.hdr[R & 1] = header_of(call, count, true);
    mine.counters[kPacked].v.store(R, std::memory_order_release);
    return R;
  } catch (...) {
    broken_ = true;
    throw;
  }
}

std::string NodeGroup::compare_calls(uint64_t round, Pending* pending, double timeout_s,
                                     const InterruptCheck& interrupt) {
  const int me = cfg_.local_rank, p = cfg_.local_size;
  const Deadline d = Deadline::after(timeout_s, interrupt, "allreduce");
  try {
    for (int j = 0; j < p; ++j)
      if (j != me) wait_counter(j, kPacked, round, d, pending);
    std::string mismatch = check_headers(round);
    finish_round(round);
    return mismatch;
  } catch (...) {
    broken_ = true;
    throw;
  }
}

bool NodeGroup::any_via_mpi(uint64_t round) const {
  for (int j = 0; j < cfg_.local_size; ++j)
    if (ctl_[j].hdr[round & 1].via_mpi) return true;
  return false;
}

}  // namespace tnt
