// The two inner blocks of kvgraft's flash-style CPU attention (AVX-512, float32), shared by prefill_attention.cpp
// and paged_attention.cpp: the scores of a few queries against a block of KB keys packed transposed, and the
// rescaled sum of the block's values into their accumulators.
#pragma once
#include <torch/extension.h>

#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's vector exp, exported by libtorch_cpu

namespace flash {

constexpr int64_t KB = 32;  // keys a block (two vectors of scores)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// r[i][j] <- r[j][i]: a 16 x 16 block of floats transposed in registers
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// Kt (D, KB) <- the nk key rows Kr[0, nk) (D = 16 NC floats each) transposed, zeros past nk: 16 x 16 blocks
// transposed in registers
template <int NC>
inline void pack_transposed(const float* const* Kr, int64_t nk, float* Kt) {
  for (int64_t j0 = 0; j0 < KB; j0 += 16)
    for (int c = 0; c < NC; ++c) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = j0 + i < nk ? _mm512_loadu_ps(Kr[j0 + i] + 16 * c) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(Kt + (16 * c + i) * KB + j0, r[i]);
    }
}

// P[m][0, KB) = Q[m] . Kt[:, 0, KB) for queries [m0, m0 + MB) of Q (M, D); Kt is (D, KB)
template <int D, int MB>
inline void scores(const float* Q, int64_t m0, const float* Kt, float* P) {
  __m512 a0[MB], a1[MB];
  for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(Kt + d * KB);
    const __m512 k1 = _mm512_loadu_ps(Kt + d * KB + 16);
    for (int i = 0; i < MB; ++i) {
      const __m512 qb = _mm512_set1_ps(Q[(m0 + i) * D + d]);
      a0[i] = _mm512_fmadd_ps(qb, k0, a0[i]);
      a1[i] = _mm512_fmadd_ps(qb, k1, a1[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm512_storeu_ps(P + (m0 + i) * KB, a0[i]);
    _mm512_storeu_ps(P + (m0 + i) * KB + 16, a1[i]);
  }
}

// O[m] = O[m] * corr[m] + sum_j P[m][j] V[j] for queries [m0, m0 + MB), keys j < nk; value rows of width 16 NCV
template <int NCV, int MB>
inline void values(const float* P, int64_t m0, const float* corr, const float* const* V, int64_t nk, float* O) {
  constexpr int Dv = 16 * NCV;
  __m512 acc[MB][NCV];
  for (int i = 0; i < MB; ++i) {
    const __m512 c = _mm512_set1_ps(corr[m0 + i]);
    for (int c2 = 0; c2 < NCV; ++c2) acc[i][c2] = _mm512_mul_ps(_mm512_loadu_ps(O + (m0 + i) * Dv + 16 * c2), c);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 vv[NCV];
    for (int c = 0; c < NCV; ++c) vv[c] = _mm512_loadu_ps(V[j] + 16 * c);
    for (int i = 0; i < MB; ++i) {
      const __m512 pb = _mm512_set1_ps(P[(m0 + i) * KB + j]);
      for (int c = 0; c < NCV; ++c) acc[i][c] = _mm512_fmadd_ps(pb, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < NCV; ++c) _mm512_storeu_ps(O + (m0 + i) * Dv + 16 * c, acc[i][c]);
}

// One query's block of scores pr[0, KB) in the online softmax: the keys outside ``keep`` masked, the running max
// ``mrow`` and sum ``l`` updated, ``corr`` the factor its earlier accumulators take; pr becomes the block's weights.
inline void online_softmax(float* pr, __mmask32 keep, float& mrow, float& corr, float& l) {
  const __m512 ninf = _mm512_set1_ps(NEG_INF);
  const __m512 s0 = _mm512_mask_blend_ps(static_cast<__mmask16>(keep), ninf, _mm512_loadu_ps(pr));
  const __m512 s1 = _mm512_mask_blend_ps(static_cast<__mmask16>(keep >> 16), ninf, _mm512_loadu_ps(pr + 16));
  const float mnew = std::max(mrow, std::max(_mm512_reduce_max_ps(s0), _mm512_reduce_max_ps(s1)));
  if (mnew == NEG_INF) {  // nothing visible yet
    std::fill(pr, pr + KB, 0.f);
    corr = 1.f;
    return;
  }
  const __m512 mv = _mm512_set1_ps(mnew);
  const __m512 p0 = Sleef_expf16_u10(_mm512_sub_ps(s0, mv));
  const __m512 p1 = Sleef_expf16_u10(_mm512_sub_ps(s1, mv));
  _mm512_storeu_ps(pr, p0);
  _mm512_storeu_ps(pr + 16, p1);
  corr = mrow == NEG_INF ? 0.f : std::exp(mrow - mnew);
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  mrow = mnew;
}

}  // namespace flash
#endif
