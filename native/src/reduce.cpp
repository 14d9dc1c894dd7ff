#include "tnt/reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tnt {
namespace {

// ---- element access: load to an accumulator type, store back (halves round to nearest even) ----

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal half -> normal float
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round-to-nearest-even float -> half (F. Giesen's float_to_half_fast3_rtne).
inline uint16_t f32_to_f16(float value) {
  uint32_t f;
  std::memcpy(&f, &value, 4);
  const uint32_t f32infty = 255u << 23;
  const uint32_t f16max = (127u + 16u) << 23;
  const uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t out;
  if (f >= f16max) {
    out = f > f32infty ? 0x7e00 : 0x7c00;  // NaN stays NaN, overflow -> inf
  } else if (f < (113u << 23)) {            // result is subnormal or zero
    float tmp, magic;
    std::memcpy(&tmp, &f, 4);
    std::memcpy(&magic, &denorm_magic_bits, 4);
    tmp += magic;
    uint32_t t;
    std::memcpy(&t, &tmp, 4);
    out = static_cast<uint16_t>(t - denorm_magic_bits);
  } else {
    uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    out = static_cast<uint16_t>(f >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <class T>
struct Plain {
  using elem = T;
  using acc = T;
  static acc load(T v) { return v; }
  static T store(acc a) { return a; }
};

// ---- halves, a block at a time, 8 elements per step (16 MB on 2 ranks, builds alternating:
// float16 19.0 -> 3.1-3.4 ms, bfloat16 3.9-4.0 -> 3.75-3.8 ms; float32 takes 1.9-2.0 ms) ----

// F16C (every x86-64 CPU since 2012, but not the baseline this is built for), chosen at run time:
// `eights` converts the whole groups of 8 with it, `one` converts the rest or everything.
#if defined(__x86_64__)
// (initialised with the library; a function-local static measured 30 % slower. The explicit
// __builtin_cpu_init makes the answer independent of the order of static initialisers.)
const bool kHasF16C = (__builtin_cpu_init(), __builtin_cpu_supports("f16c"));
__attribute__((target("avx,f16c"))) void f16_widen_f16c(const uint16_t* s, float* d, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
}
__attribute__((target("avx,f16c"))) void f16_narrow_f16c(const float* s, uint16_t* d, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
}
#else
constexpr bool kHasF16C = false;
constexpr void (*f16_widen_f16c)(const uint16_t*, float*, size_t) = nullptr;
constexpr void (*f16_narrow_f16c)(const float*, uint16_t*, size_t) = nullptr;
#endif
template <class S, class D>
void f16_convert(const S* s, D* d, size_t n, void (*eights)(const S*, D*, size_t), D (*one)(S)) {
  size_t i = 0;
  if (kHasF16C) eights(s, d, i = n / 8 * 8);
  for (; i < n; ++i) d[i] = one(s[i]);
}

struct Half {
  using elem = uint16_t;
  using acc = float;
  static acc load(uint16_t v) { return f16_to_f32(v); }
  static uint16_t store(acc a) { return f32_to_f16(a); }
  static void widen(const uint16_t* s, float* d, size_t n) {
    f16_convert(s, d, n, f16_widen_f16c, f16_to_f32);
  }
  static void narrow(const float* s, uint16_t* d, size_t n) {
    f16_convert(s, d, n, f16_narrow_f16c, f32_to_f16);
  }
};

struct BHalf {  // the top half of a float32: shifts and integer rounding, in SSE2
  using elem = uint16_t;
  using acc = float;
  static acc load(uint16_t v) { return bf16_to_f32(v); }
  static uint16_t store(acc a) { return f32_to_bf16(a); }
  static void widen(const uint16_t* s, float* d, size_t n) {
    size_t i = 0;
#if defined(__x86_64__)
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_unpacklo_epi16(zero, h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 4), _mm_unpackhi_epi16(zero, h));
    }
#endif
    for (; i < n; ++i) d[i] = load(s[i]);
  }
  static void narrow(const float* s, uint16_t* d, size_t n) {
    size_t i = 0;
#if defined(__x86_64__)
    // f32_to_bf16 on four lanes: the top half after adding 0x7fff plus its lowest bit, shifted
    // arithmetically so that SSE2's only 32 -> 16 bit pack (a signed one) keeps it. Eight lanes
    // holding a NaN go the scalar way, which keeps them NaN.
    auto round = [](__m128 f) {
      const __m128i u = _mm_castps_si128(f);
      const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
      return _mm_srai_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff))), 16);
    };
    for (; i + 8 <= n; i += 8) {
      const __m128 a = _mm_loadu_ps(s + i), b = _mm_loadu_ps(s + i + 4);
      if (_mm_movemask_ps(_mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)))) {
        for (size_t j = i; j < i + 8; ++j) d[j] = store(s[j]);
        continue;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_packs_epi32(round(a), round(b)));
    }
#endif
    for (; i < n; ++i) d[i] = store(s[i]);
  }
};

struct Sum {
  template <class A>
  static A apply(A a, A b) { return a + b; }
};
struct Min {
  template <class A>
  static A apply(A a, A b) { return b < a ? b : a; }
};
struct Max {
  template <class A>
  static A apply(A a, A b) { return a < b ? b : a; }
};

// Our own copy loop instead of memcpy: glibc copies 2 kB and more with `rep movsb`, which on
// some AMD hosts runs 15-35x slower when the destination lies 16 bytes past the source modulo
// 4 kB (128 kB: 69 us instead of 4 us). That is every copy from the shared segment (page
// aligned) into a large numpy array (malloc's mmap puts it 16 bytes past a page boundary).
// This loop has no such placement and runs level with memcpy's best elsewhere.
// With kStream the stores are non-temporal (call stream_fence() after a batch of copies).
template <bool kStream>
void vector_copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if constexpr (kStream) {  // non-temporal stores need a 16-byte aligned destination
    size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    if (head > n) head = n;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
  }
  auto store = [](char* d, __m128i v) {
    if constexpr (kStream)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), v);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), v);
  };
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    store(dst, a);
    store(dst + 16, b);
    store(dst + 32, c);
    store(dst + 48, d);
  }
  for (; n >= 16; n -= 16, dst += 16, src += 16)
    store(dst, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#endif
  std::memcpy(dst, src, n);  // the tail (< 16 bytes), or everything off x86-64
}

// dst[i] = op(a[i], b[i]) for the plain types, also stored to copy[i] when `copy` is not null,
// in explicit 16-byte vectors: GCC's vectoriser would check dst against the sources at run time
// and fall back to scalar code where they are the same array, which is every in-place allreduce.
// With kPrefetch, `a` (the caller's array, often cold) is fetched 4 kB ahead, across the page
// boundaries at which the hardware prefetcher stops (16 MB on 2 ranks: 10-15 % faster). With
// kStream, dst is written with non-temporal stores, straight from the registers that `copy` gets;
// with kStream and `stream_copy`, copy too (it must then be aligned like dst, modulo 16).
template <class T, class O, bool kPrefetch, bool kStream = false>
void combine(T* dst, T* copy, const T* a, const T* b, size_t n, bool stream_copy = false) {
  typedef T V __attribute__((vector_size(16)));
  constexpr size_t kLanes = 16 / sizeof(T);
  auto load = [](const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  auto store = [copy, dst, stream_copy](T* p, V v) {
#if defined(__x86_64__)
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<__m128i>(v));
      if (copy && stream_copy) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(copy + (p - dst)),
                         reinterpret_cast<__m128i>(v));
        return;
      }
    } else
#endif
      std::memcpy(p, &v, sizeof v);
    if (copy) std::memcpy(copy + (p - dst), &v, sizeof v);
  };
  auto scalar = [&](size_t i) {
    dst[i] = O::apply(a[i], b[i]);
    if (copy) copy[i] = dst[i];
  };
  size_t i = 0;
  if constexpr (kStream)  // non-temporal stores need an aligned destination
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) scalar(i);
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {  // one cache line per iteration
    if constexpr (kPrefetch)  // summed as an integer: the address may lie past the array
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(a + i) + 4096));
    const V x0 = O::apply(load(a + i), load(b + i));
    const V x1 = O::apply(load(a + i + kLanes), load(b + i + kLanes));
    const V x2 = O::apply(load(a + i + 2 * kLanes), load(b + i + 2 * kLanes));
    const V x3 = O::apply(load(a + i + 3 * kLanes), load(b + i + 3 * kLanes));
    store(dst + i, x0);
    store(dst + i + kLanes, x1);
    store(dst + i + 2 * kLanes, x2);
    store(dst + i + 3 * kLanes, x3);
  }
  for (; i < n; ++i) scalar(i);
}

// Works in blocks of 16 kB, so that a result read again (the next source's pass, the division,
// the copy into the shared segment) is still in L1. Plain types with two or more sources and no
// division end in one pass that writes both outputs; otherwise they accumulate in the output
// itself unless it is streamed, and halves accumulate in float32 on the stack. The first pass
// combines the first two sources: reading a cold input in a pass of its own, as a copy, streams
// memory worse than a pass that also adds (16 MB on 2 ranks: 20-25 % faster).
template <class E, class O>
void kernel(const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t n, long divisor,
            bool stream, bool stream1) {
  using T = typename E::elem;
  using A = typename E::acc;
  constexpr bool kPlain = std::is_same_v<A, T>;
  constexpr size_t kBlock = 16384 / sizeof(A);
  A acc[kBlock];
  T tmp[kPlain ? 1 : kBlock];  // halves: the rounded block before it is streamed out
  T* d0 = static_cast<T*>(dst0);
  T* d1 = static_cast<T*>(dst1);
  const A div = static_cast<A>(divisor);
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    const T* s0 = static_cast<const T*>(srcs[0]) + start;
    T* o0 = d0 + start;
    A* block = acc;
    if constexpr (kPlain) {
      if (nsrc >= 2 && divisor == 1) {
        // The last pass stores both outputs from the registers: the output (non-temporally when
        // streamed) and the copy for the other ranks in the segment (16 MB on 2 ranks: 2.6-2.8
        // -> 2.4-2.5 ms; a hot 128 kB sum with the copy: 7.5-7.8 -> 6.7-7.0 us).
        const T* last = static_cast<const T*>(srcs[nsrc - 1]) + start;
        T* copy = d1 ? d1 + start : nullptr;
        auto last_pass = [&](const T* a, auto prefetch_a) {
          constexpr bool kPrefetchA = decltype(prefetch_a)::value;
          if (stream)
            combine<T, O, kPrefetchA, true>(o0, copy, a, last, m, stream1);
          else
            combine<T, O, kPrefetchA, false>(o0, copy, a, last, m);
        };
        if (nsrc == 2) {
          last_pass(s0, std::true_type{});
        } else {
          combine<T, O, true>(acc, nullptr, s0, static_cast<const T*>(srcs[1]) + start, m);
          for (int k = 2; k < nsrc - 1; ++k)
            combine<T, O, false>(acc, nullptr, acc, static_cast<const T*>(srcs[k]) + start, m);
          last_pass(acc, std::false_type{});
        }
        continue;
      }
      if (!stream) block = o0;
      if (nsrc > 1)
        combine<T, O, true>(block, nullptr, s0, static_cast<const T*>(srcs[1]) + start, m);
      else
        copy_bytes(block, s0, m * sizeof(T));
      for (int k = 2; k < nsrc; ++k)
        combine<T, O, false>(block, nullptr, block, static_cast<const T*>(srcs[k]) + start, m);
    } else {  // halves: widened block by block, combined as float32, rounded once below
      A wide[kBlock];
      E::widen(s0, acc, m);
      for (int k = 1; k < nsrc; ++k) {
        E::widen(static_cast<const T*>(srcs[k]) + start, wide, m);
        combine<A, O, false>(acc, nullptr, acc, wide, m);
      }
    }
    if (divisor != 1)
      for (size_t i = 0; i < m; ++i) block[i] = block[i] / div;
    const T* result = o0;  // where the block's final values are
    if constexpr (!kPlain) {  // rounded once, here
      T* rounded = stream ? tmp : o0;
      E::narrow(acc, rounded, m);
      result = rounded;
    } else if (stream) {
      result = acc;
    }
    if (stream)  // the block was built in L1; it goes around the cache to the output
      vector_copy<true>(reinterpret_cast<char*>(o0), reinterpret_cast<const char*>(result),
                        m * sizeof(T));
    if (d1) copy_bytes(d1 + start, result, m * sizeof(T), stream1);
  }
}

template <class E>
void dispatch_op(Op op, const void* const* srcs, int nsrc, void* d0, void* d1, size_t n,
                 long divisor, bool stream, bool stream1) {
  switch (op) {
    case Op::sum:
      return kernel<E, Sum>(srcs, nsrc, d0, d1, n, 1, stream, stream1);
    case Op::average:
      return kernel<E, Sum>(srcs, nsrc, d0, d1, n, divisor, stream, stream1);
    case Op::min:
      return kernel<E, Min>(srcs, nsrc, d0, d1, n, 1, stream, stream1);
    case Op::max:
      return kernel<E, Max>(srcs, nsrc, d0, d1, n, 1, stream, stream1);
  }
}

template <class E>
void divide_impl(void* buf, size_t n, long divisor) {
  using T = typename E::elem;
  using A = typename E::acc;
  T* p = static_cast<T*>(buf);
  const A div = static_cast<A>(divisor);
  for (size_t i = 0; i < n; ++i) p[i] = E::store(E::load(p[i]) / div);
}

}  // namespace

void reduce(DType t, Op op, const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t n,
            long divisor, bool stream, bool stream1) {
  if (n == 0) return;
  // (both streamed from one loop only if they are aligned alike)
  stream1 = stream1 && dst1 &&
            (reinterpret_cast<uintptr_t>(dst0) - reinterpret_cast<uintptr_t>(dst1)) % 16 == 0;
  switch (t) {
    case DType::f16:
      return dispatch_op<Half>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
    case DType::bf16:
      return dispatch_op<BHalf>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
    case DType::f32:
      return dispatch_op<Plain<float>>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
    case DType::f64:
      return dispatch_op<Plain<double>>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
    case DType::i32:
      return dispatch_op<Plain<int32_t>>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
    case DType::i64:
      return dispatch_op<Plain<int64_t>>(op, srcs, nsrc, dst0, dst1, n, divisor, stream, stream1);
  }
}

void copy_bytes(void* dst, const void* src, size_t bytes, bool stream) {
  if (stream)
    vector_copy<true>(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  else
    vector_copy<false>(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void divide(DType t, void* buf, size_t n, long divisor) {
  if (divisor == 1) return;
  switch (t) {
    case DType::f16:
      return divide_impl<Half>(buf, n, divisor);
    case DType::bf16:
      return divide_impl<BHalf>(buf, n, divisor);
    case DType::f32:
      return divide_impl<Plain<float>>(buf, n, divisor);
    case DType::f64:
      return divide_impl<Plain<double>>(buf, n, divisor);
    case DType::i32:
      return divide_impl<Plain<int32_t>>(buf, n, divisor);
    case DType::i64:
      return divide_impl<Plain<int64_t>>(buf, n, divisor);
  }
}

}  // namespace tnt
