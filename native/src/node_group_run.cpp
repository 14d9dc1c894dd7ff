// NodeGroup::run: one collective in rounds, the steps of node_group.hpp's numbered list each a
// function of its own.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "node_segment.hpp"
#include "tnt/errors.hpp"
#include "tnt/node_group.hpp"
#include "tnt/reduce.hpp"

namespace tnt {
namespace {

// Large outputs go around the cache, which then keeps the segment's halves.
constexpr size_t kStreamBytes = size_t{4} << 20;

// Copies two lists of spans in alternating pieces of 1 kB: a gather, whose loads come from the
// cache and whose stores go to memory, with the next round's packing, whose loads come from
// memory and whose stores stay in the cache. Apart, each keeps only one direction of the memory
// busy; together they overlap (2 ranks, builds alternating: 16 MB 3.1-3.3 -> 2.8-3.0 ms, 64 MB
// 11.6-12.7 -> 10.2-10.5 ms; in a C model of the pipeline, the finer the pieces the better,
// down to 1 kB).
void copy_together(const std::vector<Span>& a, bool stream_a, const std::vector<Span>& b) {
  size_t ia = 0, oa = 0, ib = 0, ob = 0;
  auto step = [](const std::vector<Span>& spans, size_t& i, size_t& o, bool stream) {
    if (i == spans.size()) return;
    const Span& s = spans[i];
    const size_t n = std::min(size_t{1024}, s.bytes - o);
    copy_bytes(s.dst + o, s.src + o, n, stream);
    o += n;
    if (o == s.bytes) ++i, o = 0;
  };
  while (ia < a.size() || ib < b.size()) {
    step(a, ia, oa, stream_a);
    step(b, ib, ob, false);
  }
}

}  // namespace

// One collective: its shape (fixed at the start) and what its rounds pass on to each other.
//
// Across nodes the rounds overlap: round k's parts travel between nodes (stage B waits for them)
// while round k+1 is packed and reduced here (stage A), so that large collectives take about the
// longer of the two, not their sum. Two rounds at most are in flight: a round's half is reused
// two rounds later. On one node each round runs A then B, and B packs the next round while it
// gathers.
class NodeGroup::Collective {
 public:
  Collective(NodeGroup& g, const std::vector<Piece>& pieces, size_t count, const Call& call,
             Transport* cross, const Deadline& d, bool caller_keeps_buffers, bool this_node_only)
      : g(g),
        pieces(pieces),
        count(count),
        call(call),
        cross(cross),
        d(d),
        caller_keeps_buffers(caller_keeps_buffers),
        me(g.cfg_.local_rank),
        p(g.cfg_.local_size),
        P(g.cfg_.nparts),
        es(dtype_size(call.dtype)),
        cap(g.round_elements(es)),
        nrounds(count == 0 ? 1 : (count + cap - 1) / cap),
        world(g.cfg_.world_size),
        // (the same on every rank of the node, including those that own no part and so have no
        // `cross`)
        multi_node(g.cfg_.num_nodes > 1 && !this_node_only),
        gather(call.kind == Kind::gather),
        stream(count * es >= kStreamBytes),
        header(header_of(call, count, false)),
        first_round(g.round_ + 1) {
    if (p > 1 && call.kind == Kind::allreduce && pieces.size() == 1 && count > 0) {
      const size_t bytes = count * es;
      header.in = shared_find(pieces[0].in, bytes).value_or(SharedLoc{});
      if (!multi_node) header.out = shared_find(pieces[0].out, bytes).value_or(SharedLoc{});
    }
    std::fill(g.peer_in_.begin(), g.peer_in_.end(), nullptr);
    g.peer_out_ = nullptr;
  }

  void run() {
    for (size_t k = 0; k < nrounds; ++k) {
      stage_a(k);
      if (!multi_node)
        stage_b(k);
      else if (k > 0)
        stage_b(k - 1);
    }
    if (multi_node) {
      stage_b(nrounds - 1);
      // A rank that gave up this collective sent its part first and its notice after it: where
      // the notice is in, the collective fails here too (MPI may have taken in the part, and
      // completed ours with it, before it took in the notice).
      g.check_remote_abort(d.what);
    }
    stream_fence();
  }

  // Whether this rank's output is a shared array that the other rank may still write.
  bool shares_output() const { return header.out.fd >= 0; }

 private:
  // Where a node of one rank exchanges its part: straight from the caller's input into its output
  // (null: through our half of the segment).
  struct Direct {
    const char* in = nullptr;
    char* out = nullptr;
  };

  // Stage A: steps 1-4 up to the start of the exchange of our reduced part with other nodes.
  void stage_a(size_t k) {
    const uint64_t R = first_round + k;
    g.round_ = R;
    wait_until_half_free(R);
    publish_and_pack(k, R);
    const std::string mismatch = wait_for_packs(k, R);
    if (k == 0 && mismatch.empty()) g.map_shared_arrays(R, d);
    if (!mismatch.empty()) raise_node_mismatch(R, mismatch);
    if (me >= P || differs_across_nodes) return;  // (the gather of round 0 then raises)
    const Direct direct = reduce_own_part(k, R);
    if (!multi_node) return;
    // Round 0's exchange carries the check of the call. Later rounds cross only once it agreed:
    // ranks whose calls differ must not send each other rounds that the others never receive.
    if (k == 1) finish_exchange(0);
    if (differs_across_nodes) return;
    start_exchange(k, R, direct);
  }

  // Stage B: the end of step 4 (our part's exchange completes) and step 5.
  void stage_b(size_t k) {
    const uint64_t R = first_round + k;
    const int b = static_cast<int>(R & 1);
    RankCtl& mine = g.ctl_[me];
    if (me < P) {
      if (multi_node) finish_exchange(k);
      mine.hdr[b].status = differs_across_nodes ? 1 : 0;
    }
    if (g.peer_out_) stream_fence();  // the other rank may return once it sees `reduced`
    mine.counters[kReduced].v.store(R, std::memory_order_release);
    wait_for_owners(R);
    if (!differs_across_nodes) gather_and_pack_next(k, R);
    mine.counters[kGathered].v.store(R, std::memory_order_release);
    if (differs_across_nodes) raise_nodes_mismatch(b);
  }

  // Step 1: every peer is done with the round that last used this half.
  void wait_until_half_free(uint64_t R) {
    if (R > 2)
      for (int j = 0; j < p; ++j)
        if (j != me) g.wait_counter(j, kGathered, R - 2, d);
  }

  // Step 2: header, then pack the parts that other ranks reduce (unless the last gather did).
  void publish_and_pack(size_t k, uint64_t R) {
    RankCtl& mine = g.ctl_[me];
    if (!packed_ahead) {
      mine.hdr[R & 1] = header;
      pack_spans(k, g.packs_);
      for (const Span& s : g.packs_) copy_bytes(s.dst, s.src, s.bytes);
    }
    packed_ahead = false;
    mine.counters[kPacked].v.store(R, std::memory_order_release);
  }

  // Step 3: everyone has packed; the first round checks that all ranks make the same call (a
  // description of the calls if they differ, else empty).
  std::string wait_for_packs(size_t k, uint64_t R) {
    for (int j = 0; j < p; ++j)
      if (j != me) g.wait_counter(j, kPacked, R, d);
    return k == 0 ? g.check_headers(R) : std::string();
  }

  // Every rank of this node raises; the part owners still take part in the cross-node check
  // (saying that their node disagrees) so that the other nodes raise too.
  [[noreturn]] void raise_node_mismatch(uint64_t R, const std::string& mismatch) {
    if (me < P && multi_node) g.cross_check(g.ctl_[me].hdr[R & 1], true, cross, d, other);
    g.finish_round(R);  // keep every rank's round numbers in step: the group stays usable,
    if (g.any_via_mpi(R)) g.broken_ = true;  // unless a rank's MPI exchange went out unmatched
    throw MismatchError(mismatch);
  }

  // Step 4: reduce our own part, into our half of the segment where it then crosses to other
  // nodes, else into the output (and our half, or the other rank's shared output, for the
  // gatherers).
  Direct reduce_own_part(size_t k, uint64_t R) {
    const size_t off = k * cap;
    char* my_half = g.half(me, R);
    const size_t lo = part_bounds(k, me).first, hi = part_bounds(k, me).second;
    const Op local_op = multi_node && call.op == Op::average ? Op::sum : call.op;
    // A node of one rank whose part lies in one piece exchanges it from the caller's input
    // straight into its output (where a given-up exchange may go on reading and writing them).
    Direct direct;
    if (multi_node && p == 1 && caller_keeps_buffers)
      walk(lo, hi, [&](const char* in, char* out, size_t n, size_t) {
        if (n == hi - lo) direct.in = in, direct.out = out;
      });
    if (direct.out) return direct;
    std::vector<const void*>& srcs = g.srcs_;
    walk(lo, hi, [&](const char* in, char* out, size_t n, size_t at) {
      const size_t rel = (at - off) * es;
      int ns = 0;
      srcs[ns++] = in;
      for (int j = 0; j < p && !gather; ++j)
        if (j != me) srcs[ns++] = g.peer_in_[j] ? g.peer_in_[j] + at * es : g.half(j, R) + rel;
      if (multi_node)
        reduce(call.dtype, local_op, srcs.data(), ns, my_half + rel, nullptr, n, 1);
      else if (g.peer_out_)
        reduce(call.dtype, call.op, srcs.data(), ns, out, g.peer_out_ + at * es, n, world, stream,
               stream);
      else
        reduce(call.dtype, call.op, srcs.data(), ns, out, p > 1 ? my_half + rel : nullptr, n,
               world, stream);
    });
    return direct;
  }

  // Step 4 across nodes: our reduced part's exchange starts (round 0's with the call's check).
  void start_exchange(size_t k, uint64_t R, const Direct& direct) {
    const int b = static_cast<int>(R & 1);
    const size_t off = k * cap;
    char* my_half = g.half(me, R);
    const size_t lo = part_bounds(k, me).first, hi = part_bounds(k, me).second;
    const Op local_op = call.op == Op::average ? Op::sum : call.op;
    const char* src = direct.in ? direct.in : my_half + (lo - off) * es;
    g.exchanged_[b] = direct.out ? direct.out : my_half + (lo - off) * es;
    g.direct_[b] = direct.out != nullptr;
    if (k == 0) {
      g.fill_cross_check(g.ctl_[me].hdr[b], false);
      g.inflight_[b] = cross->start_checked_allreduce(g.cross_hdr_, src, g.exchanged_[b], hi - lo,
                                                      call.dtype, local_op);
    } else if (hi > lo) {
      g.inflight_[b] = cross->start_allreduce(src, g.exchanged_[b], hi - lo, call.dtype, local_op);
    }
  }

  // The end of step 4 across nodes: our part's exchange of round k completes (round 0's says
  // whether the call is the same on every node) and its result goes to the output.
  void finish_exchange(size_t k) {
    const int b = static_cast<int>((first_round + k) & 1);
    Pending* pending = g.inflight_[b];
    if (!pending) return;  // (finished already, or none started)
    g.inflight_[b] = nullptr;
    g.wait_pending(pending, d.what, cross->describe_peers(), d.timeout_s, *d.interrupt, cross);
    RankCtl& mine = g.ctl_[me];
    if (k == 0) {
      differs_across_nodes = !g.cross_check_result(mine.hdr[b], false, other);
      std::copy(other, other + 5, mine.hdr[b].other);  // for our node's gatherers
      if (differs_across_nodes) return;
    }
    const size_t lo = part_bounds(k, me).first, hi = part_bounds(k, me).second;
    if (call.op == Op::average) divide(call.dtype, g.exchanged_[b], hi - lo, world);
    if (g.direct_[b]) return;
    walk(lo, hi, [&](const char*, char* out, size_t n, size_t at) {
      copy_bytes(out, g.exchanged_[b] + (at - lo) * es, n * es, stream);
    });
  }

  // Step 5's wait: every other part's owner has reduced round R (and said whether the call
  // differs across nodes).
  void wait_for_owners(uint64_t R) {
    const int b = static_cast<int>(R & 1);
    for (int j = 0; j < P; ++j) {
      if (j == me) continue;
      g.wait_counter(j, kReduced, R, d);
      if (g.ctl_[j].hdr[b].status != 0) {
        // prefer a description of the other node's call over "its ranks disagree"
        const int64_t* theirs = g.ctl_[j].hdr[b].other;
        if (!differs_across_nodes || (other[0] < 0 && theirs[0] >= 0))
          std::copy(theirs, theirs + 5, other);
        differs_across_nodes = true;
      }
    }
  }

  // Step 5: gather the other parts from their owners' halves.
  void gather_and_pack_next(size_t k, uint64_t R) {
    const size_t off = k * cap;
    g.gathers_.clear();
    for (int j = 0; j < P && !g.peer_out_; ++j) {  // (else the other owner stored it here)
      if (j == me) continue;
      const char* src = g.half(j, R);
      walk(part_bounds(k, j).first, part_bounds(k, j).second,
           [&](const char*, char* out, size_t n, size_t at) {
             g.gathers_.push_back(Span{out, src + (at - off) * es, n * es});
           });
    }
    // On one node the next round's packing goes along: our half of it is free, since every
    // peer has reduced this round and so gathered the last.
    g.packs_.clear();
    if (!multi_node && k + 1 < nrounds) {
      g.ctl_[me].hdr[(R + 1) & 1] = header;
      pack_spans(k + 1, g.packs_);
      packed_ahead = true;
    }
    copy_together(g.gathers_, stream, g.packs_);
  }

  [[noreturn]] void raise_nodes_mismatch(int b) {
    stream_fence();
    g.finish_round(g.round_);  // (round 1 may be packed already): every local rank stays in step
    const Header& h = g.ctl_[me].hdr[b];
    const int64_t fields[5] = {h.kind, h.count, h.dtype, h.op, h.bucket};
    throw MismatchError(nodes_disagree(fields, other));
  }

  // The copies that pack round k's parts which other ranks reduce into our half of that round.
  void pack_spans(size_t k, std::vector<Span>& spans) {
    spans.clear();
    if (p == 1 || gather || header.in.fd >= 0) return;  // a shared input is read where it is
    char* dst = g.half(me, first_round + k);
    const size_t off = k * cap;
    for (int j = 0; j < P; ++j) {
      if (j == me) continue;
      const auto [lo, hi] = part_bounds(k, j);
      walk(lo, hi, [&](const char* in, char*, size_t n, size_t at) {
        spans.push_back(Span{dst + (at - off) * es, in, n * es});
      });
    }
  }

  // Elements [lo, hi) of part j in round k.
  std::pair<size_t, size_t> part_bounds(size_t k, int j) const {
    const size_t off = k * cap;
    const auto [lo, hi] = part_of(std::min(cap, count - std::min(count, off)), P, j);
    return std::make_pair(off + lo, off + hi);
  }

  // Walks the pieces covering elements [lo, hi) of the whole collective: fn(in, out, n, at) for
  // each piece's share, `at` its first element.
  template <class F>
  void walk(size_t lo, size_t hi, F&& fn) {
    if (lo >= hi) return;
    size_t i = 0, start = 0;
    if (lo >= cursor_start) {
      i = cursor;
      start = cursor_start;
    }
    for (; i < pieces.size() && lo < hi; ++i) {
      const size_t n = pieces[i].bytes / es;
      if (lo < start + n) {
        const size_t a = lo - start, m = std::min(hi, start + n) - lo;
        fn(pieces[i].in + a * es, pieces[i].out + a * es, m, lo);
        lo += m;
        if (lo >= hi) {
          cursor = i;
          cursor_start = start;
        }
      }
      start += n;
    }
  }

  NodeGroup& g;
  const std::vector<Piece>& pieces;
  const size_t count;
  const Call call;
  Transport* const cross;
  const Deadline& d;
  const bool caller_keeps_buffers;
  const int me, p, P;
  const size_t es;
  const size_t cap;  // elements per round: a multiple of 16 per part (parts stay 64-byte aligned)
  const size_t nrounds;
  const long world;
  const bool multi_node;
  const bool gather;  // a gather takes each part from its owner's input alone (see Kind::gather)
  const bool stream;
  Header header;
  const uint64_t first_round;
  size_t cursor = 0, cursor_start = 0;  // walk's piece index and its first element, moves forward
  bool differs_across_nodes = false;    // (only round 0 compares the calls)
  int64_t other[5] = {-1, 0, 0, 0, 0};  // a call made on another node, if it differs
  bool packed_ahead = false;            // this round's parts were packed during the last gather
};

void NodeGroup::run(const std::vector<Piece>& pieces, size_t count, const Call& call,
                    Transport* cross, double timeout_s, const InterruptCheck& interrupt,
                    bool caller_keeps_buffers, bool this_node_only) {
  const char* what = kind_name(call.kind);
  check_not_aborted(what);
  const Deadline d = Deadline::after(timeout_s, interrupt, what);
  Collective collective(*this, pieces, count, call, cross, d, caller_keeps_buffers, this_node_only);
  try {
    collective.run();
  } catch (const MismatchError&) {
    throw;
  } catch (...) {
    broken_ = true;
    for (Pending*& pending : inflight_)
      if (pending) {  // given up: MPI may still write the segment, which then stays mapped
        pending = nullptr;
        cross->abandon();
        abandoned_ = true;
      }
    // The other rank may still write a shared output.
    if (collective.shares_output()) shared_retire(pieces[0].out);
    throw;
  }
}

}  // namespace tnt
