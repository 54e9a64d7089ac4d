// SIMD lanes: the vector types and helpers the kernels are written on. Part of the extension
// tridiag_tutorial._C: tridiag.cpp includes this file (and the other headers of csrc/) into its one
// translation unit, and nothing else includes them; the code lies in an anonymous namespace there.
//
// Pack<R, W> (below): the W lanes of a block of the batched kernel (batched.h), 16-byte vectors or
// the scalar R where W = 1; Lane<V>: what the pieces kernel (pieces.h) needs to know of a vector
// type V, its 16-byte ones and the 32-byte ones of its AVX2 code; ld and st move a vector from and
// to memory, lnot negates a mask (a vector mask or a bool); TT_INLINE forces inlining.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// 32-byte vector types (the pieces kernel's AVX2 lanes) pass through the inline helpers
// below in code compiled for plain x86-64 too; GCC warns that their calling convention would
// differ there, which matters only for functions called across translation units (none are).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace {

// --------------------------------------------------------------------------------------------
// Lanes. Pack<R, W>::V is what one element of the W systems of a block is: a GCC/Clang vector
// of W reals (the compiler lowers it to the widest SIMD the target flags allow: SSE2 on plain
// x86-64), or the scalar R when W = 1. The kernels are written once on V: arithmetic is
// elementwise, comparisons give masks (bool for a scalar), and `m ? a : b` is a select (a blend
// for vectors), so there is no branch on data and no control flow to stop vectorisation.
// --------------------------------------------------------------------------------------------
// Lanes per block: one 64-byte cache line of reals per element (8 doubles, 16 floats).
template <typename R>
constexpr int kLanes = static_cast<int>(64 / sizeof(R));

#define TT_INLINE inline __attribute__((always_inline))

// 16-byte vectors: SSE2 (plain x86-64) and NEON have every operation used here on them, so GCC
// emits vector instructions (wider generic vectors would be expanded piecewise without -mavx).
// A block of W lanes is W / VL such vectors, handled side by side (independent division chains).
typedef double v2d __attribute__((vector_size(16)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v2l __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

template <typename R, int W>
struct Pack;
template <>
struct Pack<double, 8> {
  using V = v2d;
  using I = v2l;
  static constexpr int VL = 2;
  static TT_INLINE V abs(V x) { return (V)((I)x & (I{} + INT64_MAX)); }  // clear the sign bit
};
template <>
struct Pack<float, 16> {
  using V = v4f;
  using I = v4i;
  static constexpr int VL = 4;
  static TT_INLINE V abs(V x) { return (V)((I)x & (I{} + INT32_MAX)); }
};
template <typename R>
struct Pack<R, 1> {
  using V = R;
  static constexpr int VL = 1;
  static TT_INLINE V abs(V x) { return std::abs(x); }
};

template <typename V, typename R>
TT_INLINE V ld(const R* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename R>
TT_INLINE void st(R* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// A mask's negation that works for both a vector mask and a bool.
template <typename M>
TT_INLINE M lnot(const M& m) {
  return m == 0;
}

// The pieces kernel's lanes: 32-byte vectors (its AVX2 code), and for each vector type V the reals
// R of its lanes, the integer vector I of a mask and its element E, and kMag, the mask that clears
// the sign bit (PieceTile in pieces.h).
typedef double v4d __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

template <typename V>
struct Lane;
template <>
struct Lane<v2d> {
  using R = double;
  using I = v2l;
  using E = int64_t;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v4f> {
  using R = float;
  using I = v4i;
  using E = int32_t;
  static constexpr int32_t kMag = INT32_MAX;
};
template <>
struct Lane<v4d> {
  using R = double;
  using I = v4l;
  using E = int64_t;
  static constexpr int64_t kMag = INT64_MAX;
};
template <>
struct Lane<v8f> {
  using R = float;
  using I = v8i;
  using E = int32_t;
  static constexpr int32_t kMag = INT32_MAX;
};

}  // namespace
