#pragma once
// The inter-node exchange behind the shared-memory node group. The calling thread drives it (its
// waits call Pending::test); MPI implements it now, a GASPI transport could implement it later.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tnt/dtype.hpp"

namespace tnt {

// One nonblocking operation in flight.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual bool test() = 0;  // true when complete
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int size() const = 0;  // number of peers in the exchange, including self
  virtual int rank() const = 0;
  // In-place allreduce of `n` elements across the exchange (average is never passed: callers sum).
  virtual Pending* start_allreduce(void* buf, size_t n, DType t, Op op) = 0;
  // Gives up on the operation in flight after a failed wait (its resources are leaked).
  virtual void abandon() {}
  // World ranks of the peers (for error messages).
  virtual std::string describe_peers() const = 0;
};

}  // namespace tnt
