#pragma once
// Element types and reduction operations understood by the core. The numeric codes are the ones the
// Python layer passes in (they are exported by the bindings, never copied by hand).
#include <cstddef>
#include <cstdint>

namespace tnt {

enum class DType : int32_t { f16 = 0, bf16 = 1, f32 = 2, f64 = 3, i32 = 4, i64 = 5 };
enum class Op : int32_t { sum = 0, average = 1, min = 2, max = 3 };

constexpr int kNumDTypes = 6;
constexpr int kNumOps = 4;

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(Op op);
bool valid_dtype(int32_t code);
bool valid_op(int32_t code);

}  // namespace tnt
