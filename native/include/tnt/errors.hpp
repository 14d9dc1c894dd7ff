#pragma once
// Exceptions thrown by the core; the bindings map each to a Python exception class.
#include <stdexcept>
#include <string>

namespace tnt {

// Base of every failed collective.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A peer did not arrive within the collective timeout.
struct TimeoutError : CollectiveError {
  using CollectiveError::CollectiveError;
};
// A peer process died or left while we waited for it.
struct RankLostError : CollectiveError {
  using CollectiveError::CollectiveError;
};
// Another rank aborted the collective (it timed out, was interrupted, or lost a peer).
struct AbortedError : CollectiveError {
  using CollectiveError::CollectiveError;
};
// Ranks called the collective with different arguments (length, dtype, op, bucket, kind).
struct MismatchError : CollectiveError {
  using CollectiveError::CollectiveError;
};
// The interrupt check reported a pending Python exception (e.g. KeyboardInterrupt): the bindings
// re-raise that exception instead of translating this one.
struct Interrupted : std::exception {
  const char* what() const noexcept override { return "interrupted"; }
};

}  // namespace tnt
