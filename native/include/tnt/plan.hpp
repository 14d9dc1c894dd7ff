#pragma once
// The static fusion plan: tensors are grouped, in order, into buckets of one dtype until a bucket
// holds at least `threshold` bytes (threshold 0: one tensor per bucket).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tnt/dtype.hpp"

namespace tnt {

struct TensorSpec {
  std::vector<int64_t> shape;
  DType dtype;
  size_t count() const;
};

struct FusionPlan {
  std::vector<std::vector<int>> buckets;
  uint64_t hash = 0;  // over threshold, specs and buckets: equal plans on all ranks <=> equal hashes
};

FusionPlan make_fusion_plan(const std::vector<TensorSpec>& specs, size_t threshold_bytes);

}  // namespace tnt
