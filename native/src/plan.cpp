#include "tnt/plan.hpp"

namespace tnt {

size_t TensorSpec::count() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

namespace {
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
};
}  // namespace

FusionPlan make_fusion_plan(const std::vector<TensorSpec>& specs, size_t threshold_bytes) {
  FusionPlan plan;
  size_t bucket_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const size_t bytes = specs[i].count() * dtype_size(specs[i].dtype);
    // A bucket closes once it holds `threshold` bytes, and never mixes dtypes.
    bool join = !plan.buckets.empty() && bucket_bytes < threshold_bytes &&
                specs[plan.buckets.back().back()].dtype == specs[i].dtype;
    if (!join) {
      plan.buckets.emplace_back();
      bucket_bytes = 0;
    }
    plan.buckets.back().push_back(static_cast<int>(i));
    bucket_bytes += bytes;
  }
  Fnv f;
  f.add(threshold_bytes);
  f.add(specs.size());
  for (const auto& s : specs) {
    f.add(static_cast<uint64_t>(s.dtype));
    f.add(s.shape.size());
    for (int64_t d : s.shape) f.add(static_cast<uint64_t>(d));
  }
  for (const auto& b : plan.buckets) f.add(b.size());
  plan.hash = f.h;
  return plan;
}

}  // namespace tnt
