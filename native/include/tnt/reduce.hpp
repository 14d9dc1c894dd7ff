#pragma once
// Elementwise reduction kernels over raw buffers (dtype x op).
#include <cstddef>

#include "tnt/dtype.hpp"

namespace tnt {

// dst0[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) for i < n, also stored to dst1 when it is not null.
// For Op::average the combined value is divided by `divisor` (integers: C division, truncating toward
// zero); pass divisor 1 to get the plain sum (e.g. before a further cross-node step).
// float16 / bfloat16 accumulate in float32 and round once.
// With `stream`, dst0 is written with non-temporal stores: for large outputs that would only
// evict the shared segment from the cache (and cost a read-for-ownership) otherwise; with
// `stream1` dst1 too (another rank's output rather than the segment).
void reduce(DType t, Op op, const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t n,
            long divisor, bool stream = false, bool stream1 = false);

// A copy with no slow paths for any placement of the buffers (memcpy has some: see reduce.cpp),
// with non-temporal stores when `stream`; call stream_fence() after a batch of those.
void copy_bytes(void* dst, const void* src, size_t bytes, bool stream = false);
void stream_fence();

// In-place division for Op::average after a cross-node sum: buf[i] /= divisor.
void divide(DType t, void* buf, size_t n, long divisor);

}  // namespace tnt
