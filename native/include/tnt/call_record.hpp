#pragma once
// What a rank's engine is doing now, readable from any thread while the calling thread waits in
// it: the collectives it is in, each numbered as every rank numbers it (the n-th collective of
// every rank's engine is the same call: the call check holds them to it), and how many it has
// entered. The stack report (tnt_notebook/rank/stack_report.py) reads it from a side thread to
// say which collective a rank waits in and which ranks have not arrived there.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "tnt/call_check.hpp"

namespace tnt {

// One collective a rank is in: what `kind` names ("allreduce", "barrier", "broadcast", or
// "start-up" for the engine's bootstrap, number 0), its call and its bytes.
struct ActiveCall {
  uint64_t seq = 0;
  const char* kind = "";
  Call call;
  size_t count = 0;
  size_t bytes = 0;
  std::chrono::steady_clock::time_point since;
};

class CallRecord {
 public:
  // A new collective: its number (1 for the engine's first). `seq` > 0: the second half of one
  // entered before under that number (finish_allreduce of start_allreduce's call).
  uint64_t enter(const char* kind, const Call& call, size_t count, size_t bytes, uint64_t seq = 0);
  // `failed`: it ended in an error (a time-out, an interrupt): kept as the last failed one.
  void leave(uint64_t seq, bool failed);
  // The oldest collective still in progress (the one the others wait behind), if any.
  bool oldest(ActiveCall* out) const;
  // The last collective that ended in an error, if any (`since`: when it began).
  bool last_failed(ActiveCall* out) const;
  uint64_t entered() const;

 private:
  mutable std::mutex m_;
  uint64_t entered_ = 0;
  std::vector<ActiveCall> active_;
  ActiveCall failed_;  // seq 0: none (the start-up's failures are not numbered)
};

// Marks a collective for the life of the scope.
class InCall {
 public:
  InCall(CallRecord& r, const char* kind, const Call& call, size_t count, size_t bytes,
         uint64_t seq = 0)
      : r_(r), seq_(r.enter(kind, call, count, bytes, seq)) {}
  ~InCall() { r_.leave(seq_, std::uncaught_exceptions() > 0); }
  InCall(const InCall&) = delete;
  InCall& operator=(const InCall&) = delete;
  uint64_t seq() const { return seq_; }

 private:
  CallRecord& r_;
  uint64_t seq_;
};

}  // namespace tnt
