#pragma once
// MPI's own collectives over a communicator: MPI_Allreduce's path over the world
// (Engine::allreduce_mpi), broadcasts, and the engine's agreement on measured times; and plain
// messages, for the posted allreduces of two ranks (Engine::post). Not a Transport: the exchanges
// between nodes are MpiTransport's (or GASPI's), and checked calls go here as blobs.
#include <mpi.h>

#include <map>
#include <vector>

#include "tnt/transport.hpp"

namespace tnt {

class MpiCollectives : public Abandonable {
 public:
  // Takes ownership of `comm`; `world_ranks` names its members for error messages.
  MpiCollectives(MPI_Comm comm, std::vector<int> world_ranks);
  ~MpiCollectives() override;
  int size() const { return size_; }
  int rank() const { return rank_; }
  // Allreduce of `n` elements (at most INT_MAX) from `in` into `out`, which may be `in` or
  // MPI_IN_PLACE.
  Pending* start_allreduce(const void* in, void* out, size_t n, DType t, Op op);
  // World ranks of the other members (for error messages).
  std::string describe_peers() const { return ranks_but(world_ranks_, rank_); }
  // Allreduce of a blob: kCheckValues int64 (a call check, see fill_call_check, reduced with
  // max) followed by `n` elements of `t`, reduced with the check's op (average as a sum) where
  // every rank's check is the same, else left alone. One MPI datatype covers the whole blob, so
  // MPI moves it in one piece: the check costs no message of its own.
  Pending* start_blob_allreduce(void* blob, size_t n, DType t);
  // A message of raw bytes sent to (`send`) or received from `peer`, a rank of this communicator
  // (at most INT_MAX bytes; one tag: messages between two ranks match in the order posted).
  Pending* start_message(bool send, void* buf, size_t bytes, int peer);
  // Broadcast of raw bytes from `root` (at most 1 GiB per call).
  Pending* start_bcast(void* buf, size_t bytes, int root);
  // Leak the communicator instead of freeing it (after an abandoned operation).
  void abandon() override { abandoned_ = true; }

 private:
  MPI_Comm comm_;
  int size_ = 1, rank_ = 0;
  std::vector<int> world_ranks_;
  bool abandoned_ = false;
  std::map<size_t, MPI_Datatype> blob_types_;  // by blob size
};

// Throws CollectiveError with MPI's message when rc is not MPI_SUCCESS.
void check_mpi(int rc, const char* what);

// MPI datatype/op for a core dtype/op (user-defined ops for float16 / bfloat16).
MPI_Datatype mpi_datatype(DType t);
MPI_Op mpi_op(DType t, Op op);

}  // namespace tnt
