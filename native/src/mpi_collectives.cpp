#include "tnt/mpi_collectives.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "tnt/errors.hpp"
#include "tnt/reduce.hpp"

namespace tnt {
namespace {

class MpiPending : public Pending {
 public:
  MPI_Request req = MPI_REQUEST_NULL;
  bool test() override {
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }
};

// MPI has no portable float16 / bfloat16: reduce them (as 16-bit integers) with our kernels.
template <DType T, Op O>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* srcs[2] = {inout, in};
  reduce(T, O, srcs, 2, inout, nullptr, static_cast<size_t>(*len), 1);
}

// The reduction of checked blobs (start_blob_allreduce): the check part with max; the elements
// only where both checks say that every rank so far made the same call, which gives their dtype,
// op and count.
void blob_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int bytes = 0;
  MPI_Type_size(*type, &bytes);
  for (int b = 0; b < *len; ++b) {
    auto* x = reinterpret_cast<int64_t*>(static_cast<char*>(in) + static_cast<size_t>(b) * bytes);
    auto* y = reinterpret_cast<int64_t*>(static_cast<char*>(inout) + static_cast<size_t>(b) * bytes);
    // (the call's op: average reduces as a sum here, its divisor being 1)
    const int64_t count = x[1], dtype = x[2], op = x[3];
    const bool same = std::equal(x, x + kCheckValues, y) && check_agrees(x) &&
                      valid_dtype(static_cast<int32_t>(dtype)) &&
                      valid_op(static_cast<int32_t>(op)) && count >= 0 &&
                      static_cast<size_t>(count) * dtype_size(static_cast<DType>(dtype)) ==
                          static_cast<size_t>(bytes) - kCheckBytes;
    if (same) {
      const void* srcs[2] = {y + kCheckValues, x + kCheckValues};
      reduce(static_cast<DType>(dtype), static_cast<Op>(op), srcs, 2, y + kCheckValues, nullptr,
             static_cast<size_t>(count), 1);
    }
    for (int i = 0; i < kCheckValues; ++i) y[i] = std::max(x[i], y[i]);
  }
}

}  // namespace

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw CollectiveError(std::string(what) + " failed: " + std::string(msg, len));
  }
}

MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16:
      return MPI_UINT16_T;
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(DType t, Op op) {
  if (t == DType::f16 || t == DType::bf16) {
    static std::once_flag once;
    static MPI_Op ops[2][3];
    std::call_once(once, [] {
      MPI_Op_create(&half_op<DType::f16, Op::sum>, 1, &ops[0][0]);
      MPI_Op_create(&half_op<DType::f16, Op::min>, 1, &ops[0][1]);
      MPI_Op_create(&half_op<DType::f16, Op::max>, 1, &ops[0][2]);
      MPI_Op_create(&half_op<DType::bf16, Op::sum>, 1, &ops[1][0]);
      MPI_Op_create(&half_op<DType::bf16, Op::min>, 1, &ops[1][1]);
      MPI_Op_create(&half_op<DType::bf16, Op::max>, 1, &ops[1][2]);
    });
    int k = op == Op::min ? 1 : op == Op::max ? 2 : 0;
    return ops[t == DType::bf16][k];
  }
  return op == Op::min ? MPI_MIN : op == Op::max ? MPI_MAX : MPI_SUM;
}

MpiCollectives::MpiCollectives(MPI_Comm comm, std::vector<int> world_ranks)
    : comm_(comm), world_ranks_(std::move(world_ranks)) {
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_rank(comm_, &rank_);
}

MpiCollectives::~MpiCollectives() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (abandoned_ || finalized) return;
  for (auto& [bytes, type] : blob_types_) MPI_Type_free(&type);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Pending* MpiCollectives::start_blob_allreduce(void* blob, size_t n, DType t) {
  static MPI_Op blob_mpi_op = [] {
    MPI_Op o;
    MPI_Op_create(&blob_op, 1, &o);
    return o;
  }();
  const size_t bytes = kCheckBytes + n * dtype_size(t);
  if (bytes > static_cast<size_t>(INT_MAX)) throw CollectiveError("checked blob too large");
  auto it = blob_types_.find(bytes);
  if (it == blob_types_.end()) {
    MPI_Datatype type;
    check_mpi(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type), "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&type), "MPI_Type_commit");
    it = blob_types_.emplace(bytes, type).first;
  }
  const MPI_Datatype type = it->second;
  auto* p = new MpiPending;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, blob, 1, type, blob_mpi_op, comm_, &p->req);
  if (rc != MPI_SUCCESS) {
    delete p;
    check_mpi(rc, "MPI_Iallreduce");
  }
  return p;
}

Pending* MpiCollectives::start_allreduce(const void* in, void* out, size_t n, DType t, Op op) {
  if (in == out) in = MPI_IN_PLACE;
  if (n > static_cast<size_t>(INT_MAX))
    throw CollectiveError("allreduce of more than INT_MAX elements in one MPI call");
  auto* p = new MpiPending;
  int rc = MPI_Iallreduce(in, out, static_cast<int>(n), mpi_datatype(t), mpi_op(t, op), comm_,
                          &p->req);
  if (rc != MPI_SUCCESS) {
    delete p;
    check_mpi(rc, "MPI_Iallreduce");
  }
  return p;
}

Pending* MpiCollectives::start_message(bool send, void* buf, size_t bytes, int peer) {
  if (bytes > static_cast<size_t>(INT_MAX))
    throw CollectiveError("a message of more than INT_MAX bytes");
  auto* p = new MpiPending;
  int rc = send ? MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &p->req)
                : MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &p->req);
  if (rc != MPI_SUCCESS) {
    delete p;
    check_mpi(rc, send ? "MPI_Isend" : "MPI_Irecv");
  }
  return p;
}

Pending* MpiCollectives::start_bcast(void* buf, size_t bytes, int root) {
  auto* p = new MpiPending;
  int rc = MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_, &p->req);
  if (rc != MPI_SUCCESS) {
    delete p;
    check_mpi(rc, "MPI_Ibcast");
  }
  return p;
}

}  // namespace tnt
