// Small float32 blocks on ATen's Vectorized<float> (torch's own SIMD types, its vector exp included) at the width
// the build targets: AVX-512, AVX2 or plain C++. The kernels that have no hand-tuned path for a CPU run these (the
// causal encoder-decoder's decode rows everywhere, paged attention where AVX-512 is missing). Include this header
// before any other ATen header of the file: it chooses the width ATen's headers build.
//
// ATen names its inline namespace after CPU_CAPABILITY; naming it here keeps this build's Vectorized apart from any
// other width's at link time (every kvgraft source is built with the same flags, so they all agree).
#pragma once
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY kvgraft_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY kvgraft_avx2
#else
#define CPU_CAPABILITY kvgraft_default
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace vecb {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

// a . b over n floats: VL at a time, the last vector partial
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t c = 0;
  for (; c + VL <= n; c += VL) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  if (c < n) acc = at::vec::fmadd(Vec::loadu(a + c, n - c), Vec::loadu(b + c, n - c), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// y += w x over n floats
inline void axpy(float w, const float* x, float* y, int64_t n) {
  const Vec wv(w);
  int64_t c = 0;
  for (; c + VL <= n; c += VL) at::vec::fmadd(wv, Vec::loadu(x + c), Vec::loadu(y + c)).store(y + c);
  if (c < n) at::vec::fmadd(wv, Vec::loadu(x + c, n - c), Vec::loadu(y + c, n - c)).store(y + c, n - c);
}

// s[0, L) <- softmax(s) in place; -inf scores (keys not seen) get weight 0; at least one score finite
inline void softmax(float* s, int64_t L) {
  const float mx = *std::max_element(s, s + L);
  const Vec mv(mx);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + VL <= L; i += VL) {
    const Vec e = (Vec::loadu(s + i) - mv).exp();
    e.store(s + i);
    acc = acc + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < L; ++i) sum += (s[i] = std::exp(s[i] - mx));
  const Vec inv(1.f / sum);
  for (i = 0; i + VL <= L; i += VL) (Vec::loadu(s + i) * inv).store(s + i);
  for (; i < L; ++i) s[i] *= 1.f / sum;
}

}  // namespace vecb
