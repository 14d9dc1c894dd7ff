// The node group's waits: for local ranks' counters and for exchanges in flight, each bounded by
// its deadline and ended early by an abort (here or on another node), a peer's death or departure,
// or an interrupt.
#include <chrono>
#include <cstdio>
#include <memory>

#include "node_segment.hpp"
#include "tnt/errors.hpp"
#include "tnt/node_group.hpp"

namespace tnt {

void NodeGroup::check_remote_abort(const char* what) {
  if (!poll_remote_) return;
  last_remote_poll_ = std::chrono::steady_clock::now();
  std::string msg = poll_remote_();
  if (msg.empty()) return;
  abort(msg, false);  // our node's ranks learn it from the segment
  throw AbortedError(std::string(what) + " aborted on another node: " + msg);
}

// The slow path of every wait: abort flag, liveness of the awaited rank, deadline, interrupt.
void NodeGroup::checks(const Deadline& d, int awaited, const std::function<bool()>& arrived) {
  int a = hdr_->abort_local.load(std::memory_order_acquire);
  if (a >= 0 && a != cfg_.local_rank) {
    broken_ = true;
    throw AbortedError(std::string(d.what) + " aborted by rank " +
                       std::to_string(ctl_[a].world_rank) + ": " + ctl_[a].abort_msg);
  }
  check_remote_abort(d.what);
  if (awaited >= 0) check_alive(d, awaited, arrived);
  if (std::chrono::steady_clock::now() > d.end) return;  // the caller reports the timeout
  if (d.interrupt && *d.interrupt && (*d.interrupt)()) {
    abort(std::string("rank ") + std::to_string(cfg_.world_ranks[cfg_.local_rank]) +
          " was interrupted during " + d.what);
    throw Interrupted();
  }
}

void NodeGroup::check_alive(const Deadline& d, int local, const std::function<bool()>& arrived) {
  RankCtl& peer = ctl_[local];
  const bool closed = peer.state.load(std::memory_order_acquire) == kClosed;
  const bool dead = !closed && !process_alive(peer.pid);
  // It may have reached the awaited stage just before leaving: then nothing is lost.
  if (!(closed || dead) || (arrived && arrived())) return;
  std::string who = "rank " + std::to_string(cfg_.world_ranks[local]) + " (pid " +
                    std::to_string(peer.pid) + ")";
  if (closed) {
    abort(who + " left during " + d.what);
    throw RankLostError(who + " left (shut down its engine) during " + d.what);
  }
  abort(who + " died during " + d.what);
  throw RankLostError(who + " died during " + d.what);
}

void NodeGroup::fail_timeout(const Deadline& d, int which, uint64_t value) {
  std::string missing;
  for (int j = 0; j < cfg_.local_size; ++j) {
    if (j == cfg_.local_rank) continue;
    if (ctl_[j].counters[which].v.load(std::memory_order_acquire) < value) {
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(cfg_.world_ranks[j]);
    }
  }
  char secs[32];
  snprintf(secs, sizeof secs, "%g", d.timeout_s);
  std::string msg = std::string(d.what) + " timed out after " + secs + " s: rank(s) " +
                    (missing.empty() ? "?" : missing) + " did not arrive";
  abort(msg);
  throw TimeoutError(msg);
}

// A local rank that waits on other nodes has not failed to arrive: its own wait names those nodes
// when it ends (a little after ours), and its abort then ends ours with that message.
bool NodeGroup::awaits_other_nodes(int local, std::chrono::steady_clock::time_point now) const {
  const int64_t until = ctl_[local].awaits_nodes_until.load(std::memory_order_acquire);
  return until != 0 && now.time_since_epoch() < std::chrono::nanoseconds(until) +
                                                     std::chrono::seconds(kAbortArrivalSeconds);
}

void NodeGroup::wait_counter(int local, int which, uint64_t value, const Deadline& d,
                             Pending* progress) {
  std::atomic<uint64_t>& c = ctl_[local].counters[which].v;
  if (c.load(std::memory_order_acquire) >= value) return;
  Backoff backoff;
  const auto start = std::chrono::steady_clock::now();
  while (c.load(std::memory_order_acquire) < value) {
    // The exchanges in flight progress only while someone calls into the transport.
    for (Pending* pending : inflight_)
      if (pending) pending->test();
    if (progress) progress->test();
    if (backoff.pause()) {
      checks(d, local, [&] { return c.load(std::memory_order_acquire) >= value; });
      if (c.load(std::memory_order_acquire) >= value) break;
      const auto now = std::chrono::steady_clock::now();
      if (now > d.end && !awaits_other_nodes(local, now)) fail_timeout(d, which, value);
    }
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NodeGroup::wait_pending(Pending* pending, const char* what, const std::string& peers,
                             double timeout_s, const InterruptCheck& interrupt,
                             Abandonable* to_abandon, bool world_collective) {
  std::unique_ptr<Pending> own(pending);
  // A rank that never arrives is named by its own node's ranks, whose waits on it end first: a
  // wait on other nodes ends a little after the timeout, once their notice had time to come.
  const double grace = cfg_.num_nodes > 1 ? kRemoteWaitGraceSeconds : 0.0;
  Deadline d = Deadline::after(timeout_s, interrupt, what, grace);
  // (steady_clock is CLOCK_MONOTONIC, the same in every process of the host)
  ctl_[cfg_.local_rank].awaits_nodes_until.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(d.end.time_since_epoch()).count(),
      std::memory_order_release);
  struct Clear {
    std::atomic<int64_t>& until;
    ~Clear() { until.store(0, std::memory_order_release); }
  } clear{ctl_[cfg_.local_rank].awaits_nodes_until};
  Backoff backoff(world_collective);
  // A peer that left or died may have done its part of the exchange first (MPI then completes
  // ours soon): it is only reported if the exchange is still incomplete a grace period later.
  std::chrono::steady_clock::time_point lost_at{};
  auto in_grace = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (lost_at == std::chrono::steady_clock::time_point{}) lost_at = now;
    return now - lost_at < std::chrono::seconds(1);
  };
  try {
    while (!pending->test()) {
      if (backoff.pause()) {
        checks(d, -1, nullptr);
        if (world_collective)
          for (int j = 0; j < cfg_.local_size; ++j)
            if (j != cfg_.local_rank) check_alive(d, j, in_grace);
        if (std::chrono::steady_clock::now() > d.end) {
          char secs[32];
          snprintf(secs, sizeof secs, "%g", timeout_s);
          std::string msg = std::string(what) + " timed out after " + secs +
                            " s: the exchange with rank(s) " + peers + " did not complete";
          abort(msg);
          throw TimeoutError(msg);
        }
      }
    }
  } catch (...) {
    if (!broken_) {  // the exchange itself failed (no check did): this node's ranks must not wait
      try {         // for us (the transport's peers on other nodes found out themselves)
        throw;
      } catch (const std::exception& e) {
        abort(e.what(), false);
      } catch (...) {
        abort("the inter-node exchange failed", false);
      }
    }
    broken_ = true;
    if (to_abandon) {
      to_abandon->abandon();
      abandoned_ = true;
    }
    throw;
  }
}

void NodeGroup::check_not_aborted(const char* what) {
  if (broken_) throw AbortedError("the engine was aborted; it must be rebuilt");
  int a = hdr_->abort_local.load(std::memory_order_acquire);
  if (a >= 0) {
    broken_ = true;
    throw AbortedError(std::string(what) + " aborted by rank " +
                       std::to_string(ctl_[a].world_rank) + ": " + ctl_[a].abort_msg);
  }
  // Polling other nodes is a system call: back-to-back calls poll once a millisecond (a wait
  // polls every few milliseconds anyway).
  if (std::chrono::steady_clock::now() - last_remote_poll_ >= std::chrono::milliseconds(1))
    check_remote_abort(what);
}

}  // namespace tnt
