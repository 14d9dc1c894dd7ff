#include "tnt/call_check.hpp"

#include <algorithm>
#include <cstdio>

namespace tnt {

void call_fields(Kind kind, size_t count, DType dtype, Op op, int64_t bucket, bool node_disagrees,
                 int64_t fields[6]) {
  fields[0] = static_cast<int64_t>(kind);
  fields[1] = static_cast<int64_t>(count);
  fields[2] = static_cast<int64_t>(dtype);
  fields[3] = static_cast<int64_t>(op);
  fields[4] = bucket;
  fields[5] = node_disagrees ? 1 : 0;
}

void fill_call_check(const int64_t fields[6], int64_t v[kCheckValues]) {
  for (int i = 0; i < 6; ++i) v[i] = fields[i], v[6 + i] = -fields[i];
}

bool call_check_result(const int64_t fields[6], const int64_t v[kCheckValues], int64_t other[5]) {
  bool same = true;
  for (int i = 0; i < 6; ++i) same = same && v[i] == -v[6 + i];
  if (!same) {  // one of max and min is another call
    int64_t lo[5];
    for (int i = 0; i < 5; ++i) lo[i] = -v[6 + i];
    const bool max_is_mine = std::equal(v, v + 5, fields);
    std::copy(max_is_mine ? lo : v, (max_is_mine ? lo : v) + 5, other);
    if (max_is_mine && std::equal(lo, lo + 5, fields))
      other[0] = -1;  // the same call everywhere, but some node's ranks disagree among themselves
  }
  return same;
}

bool check_agrees(const int64_t check[kCheckValues]) {
  for (int i = 0; i < kCheckValues / 2; ++i)
    if (check[i] != -check[kCheckValues / 2 + i]) return false;
  return check[5] == 0;  // (no node said that its ranks disagree)
}

std::string describe_call(const int64_t fields[5], bool via_mpi) {
  const int64_t kind_code = fields[0], count = fields[1], dtype = fields[2], op = fields[3],
                bucket = fields[4];
  char buf[160];
  auto kind = static_cast<Kind>(kind_code);
  if (kind_code < 0 || kind_code > 3 || !valid_dtype(static_cast<int32_t>(dtype)) ||
      !valid_op(static_cast<int32_t>(op)))
    return "a different call";
  if (kind == Kind::barrier) return "barrier";
  if (kind == Kind::broadcast) {
    snprintf(buf, sizeof buf, "broadcast from root %lld", static_cast<long long>(bucket));
    return buf;
  }
  snprintf(buf, sizeof buf, "%s of %lld x %s (op %s%s",
           kind == Kind::gather ? "gather of an allreduce" : "allreduce",
           static_cast<long long>(count), dtype_name(static_cast<DType>(dtype)),
           op_name(static_cast<Op>(op)), bucket >= 0 ? ", bucket " : "");
  std::string s = buf;
  if (bucket >= 0) s += std::to_string(bucket);
  return s + (via_mpi ? ", through MPI)" : ")");
}

std::string ranks_disagree(const int64_t mine[5], const int64_t other[5]) {
  return "ranks called collectives with different arguments: this rank: " + describe_call(mine) +
         "; another rank: " + describe_call(other);
}

std::string nodes_disagree(const int64_t mine[5], const int64_t other[5]) {
  return "ranks on different nodes called collectives with different arguments: this node: " +
         describe_call(mine) + "; another node: " +
         (other[0] < 0 ? std::string("its ranks disagree among themselves") : describe_call(other));
}

}  // namespace tnt
