#pragma once
// The check that every rank makes the same collective call: each rank's call as fields, their
// reduction across ranks (max of the fields and of their negations: one allreduce tells whether
// all agree and names another call if not), and the messages of a mismatch. The node group
// compares headers in the segment inside a node; this check carries the comparison between nodes
// and through MPI.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tnt/dtype.hpp"

namespace tnt {

// A gather (within one node only) writes part j of every rank's output from local rank j's
// input: the last step of an allreduce whose parts were reduced across nodes elsewhere.
enum class Kind : int32_t { allreduce = 0, barrier = 1, broadcast = 2, gather = 3 };

struct Call {
  Kind kind = Kind::allreduce;
  DType dtype = DType::f32;
  Op op = Op::sum;
  int64_t bucket = -1;  // fusion bucket index, -1 for a plain allreduce, root for a broadcast
};

// A reduced call check: kCheckValues int64, the fields and their negations.
constexpr int kCheckValues = 12;
constexpr size_t kCheckBytes = kCheckValues * sizeof(int64_t);

// The fields of a call check: (kind, count, dtype, op, bucket, 1 if the caller's node disagrees).
void call_fields(Kind kind, size_t count, DType dtype, Op op, int64_t bucket, bool node_disagrees,
                 int64_t fields[6]);

// `fields` and their negations go into `v`, to be reduced with max across the ranks; then
// call_check_result tells whether all made the call of `fields`, else `other` holds another call
// (kind -1: the same call everywhere, but some node's ranks disagree).
void fill_call_check(const int64_t fields[6], int64_t v[kCheckValues]);
bool call_check_result(const int64_t fields[6], const int64_t v[kCheckValues], int64_t other[5]);

// True when a reduced call check says that every rank made the same call and agreed with its node.
bool check_agrees(const int64_t check[kCheckValues]);

// "allreduce of 4 x float32 (op sum, bucket 2)" for a call (kind, count, dtype, op, bucket);
// `via_mpi`: the rank carries it out through MPI_Allreduce.
std::string describe_call(const int64_t fields[5], bool via_mpi = false);

// The message of a call (kind, count, dtype, op, bucket) that differs from one made on another
// node (kind -1: that node's ranks disagree among themselves).
std::string nodes_disagree(const int64_t mine[5], const int64_t other[5]);
// The message of a call that differs from another rank's (`other`: a call of kind >= 0).
std::string ranks_disagree(const int64_t mine[5], const int64_t other[5]);

}  // namespace tnt
