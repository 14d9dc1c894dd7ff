#include "tnt/dtype.hpp"

namespace tnt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int32", "int64"};
  return valid_dtype(static_cast<int32_t>(t)) ? names[static_cast<int>(t)] : "invalid dtype";
}

const char* op_name(Op op) {
  static const char* names[] = {"sum", "average", "min", "max"};
  return valid_op(static_cast<int32_t>(op)) ? names[static_cast<int>(op)] : "invalid op";
}

bool valid_dtype(int32_t code) { return code >= 0 && code < kNumDTypes; }
bool valid_op(int32_t code) { return code >= 0 && code < kNumOps; }

}  // namespace tnt
