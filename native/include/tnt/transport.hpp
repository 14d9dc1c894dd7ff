#pragma once
// The inter-node exchange behind the shared-memory node group. The calling thread drives it (its
// waits call Pending::test). MPI point-to-point messages implement it (mpi_transport.hpp), and
// GASPI where GPI-2 is installed (gaspi_transport.hpp).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tnt/call_check.hpp"
#include "tnt/dtype.hpp"

namespace tnt {

// One nonblocking operation in flight.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual bool test() = 0;  // true when complete
};

// "1, 3, 4": the world ranks of the members of an exchange but member `self` ("none" if none).
std::string ranks_but(const std::vector<int>& world_ranks, int self);

// What a failed wait gives up on: whatever carries the operation in flight.
class Abandonable {
 public:
  virtual ~Abandonable() = default;
  // Gives up on the operation in flight after a failed wait (its resources are leaked).
  virtual void abandon() {}
};

class Transport : public Abandonable {
 public:
  virtual int size() const = 0;  // number of peers in the exchange, including self
  virtual int rank() const = 0;
  // Allreduce of `n` elements from `in` into `out` across the exchange; `in` may be `out`
  // (average is never passed: callers sum).
  virtual Pending* start_allreduce(const void* in, void* out, size_t n, DType t, Op op) = 0;
  // The same with a call check: `check` is reduced with max across the exchange, and the elements
  // only if the reduced check agrees (check_agrees; else `out` is undefined). Ranks may pass
  // different `n`, `t` and `op` (an exchange never carries more than the node group's part of a
  // round): the exchange completes all the same, so that every rank can report the mismatch.
  virtual Pending* start_checked_allreduce(int64_t* check, const void* in, void* out, size_t n,
                                           DType t, Op op) = 0;
  // World ranks of the peers (for error messages).
  virtual std::string describe_peers() const = 0;
};

}  // namespace tnt
