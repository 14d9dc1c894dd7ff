#pragma once
// The exchange between nodes over MPI point-to-point messages, with algorithms of our own rather
// than MPI_Iallreduce: a call check travels in front of the data instead of in an exchange of
// its own, the result goes straight to the caller's output, and the data moves in fragments that
// are reduced as they arrive.
//
// Algorithms, by the number of nodes N and the bytes S of the part exchanged:
//   - S + head <= kFragmentBytes: recursive doubling over messages [head | data] (with N not a
//     power of two, the first ranks fold in pairwise first and get the result last). A pair
//     reduces the lower rank's elements with the higher rank's, so every rank computes the same
//     tree and gets the same bits;
//   - larger S, N == 2: the parts swapped, fragment by fragment (pairwise);
//   - larger S, N > 2: ring reduce-scatter, then allgather (each node sends and receives
//     2(N-1)/N S: the link's bound).
// A checked call with a larger part swaps heads alone first (recursive doubling): with 2 nodes its
// fragments go out at once and are received where the peer's head says they come; with more, the
// ring starts only where every head agreed. So ranks that called with different sizes still
// exchange messages that match, and every receive has room for what can arrive.
//
// Why fragments (measured between 2 test hosts, MPICH 5.0.2 over UCX's TCP, which sends up to
// 65528 bytes as one eager message and more in several): one message of 64 KB took 25 us, but 49
// us after any transfer of 16 MB, where two of 32 KB took 26-30 us; 1 MB in fragments of 60 KB
// took 239 us, in one message 281 us, in fragments of 128 or 256 KB 310-350 us, MPI_Allreduce 325
// us. A pair of 4 KB messages took 14 us where MPI_Allreduce (and MPI_Iallreduce) took 28 us.
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "tnt/transport.hpp"

namespace tnt {

constexpr size_t kFragmentBytes = size_t{60} << 10;

class MpiTransport : public Transport {
 public:
  // Takes ownership of `comm`; `world_ranks` names its members for error messages. No exchange
  // carries more than `max_bytes` (the node group's part of a round, the same on every rank).
  MpiTransport(MPI_Comm comm, std::vector<int> world_ranks, size_t max_bytes);
  ~MpiTransport() override;
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  // The world rank of member `i`.
  int world_rank(int i) const { return world_ranks_[static_cast<size_t>(i)]; }
  Pending* start_allreduce(const void* in, void* out, size_t n, DType t, Op op) override;
  Pending* start_checked_allreduce(int64_t* check, const void* in, void* out, size_t n, DType t,
                                   Op op) override;
  // Leaks the communicator and the buffers of exchanges in flight instead of freeing them.
  void abandon() override { abandoned_ = true; }
  std::string describe_peers() const override { return ranks_but(world_ranks_, rank_); }

 private:
  friend class MpiExchange;
  Pending* start(int64_t* check, const void* in, void* out, size_t n, DType t, Op op);
  char* take_buffer();
  void give_back(char* buffer) { free_.push_back(buffer); }

  MPI_Comm comm_;
  int size_ = 1, rank_ = 0;
  std::vector<int> world_ranks_;
  size_t max_bytes_;
  size_t buffer_bytes_;  // one exchange's send and receive areas
  uint64_t started_ = 0;
  bool abandoned_ = false;
  std::vector<char*> free_;  // buffers of completed exchanges, for the next ones
};

}  // namespace tnt
