// Prefill attention over paged keys/values read in place, for the CPU (float32, AVX-512): flash-style, the
// scores of a block of queries against a block of keys at a time, an online softmax, nothing the size of
// queries x keys ever stored.
//
// prefill_attention(q, k, v, mask, index, scale) -> (G, H, T, Dv), the arguments of decode_attention:
//   q     (G, H, T, D)   the group's queries (T new tokens per row)
//   k     (K, n, S, D)   keys of K heads for n slots, any strides but the last
//   v     (K, n, S, Dv)  values, laid out as k
//   mask  (G, T, S)      bool, true = the query attends the key
//   index (G,) int64     the slot of each row among the n (empty: row g is slot g)
// Query head h reads key head h / (H / K). One task is (row, key head, QT query tokens): its H/K * QT queries
// (in registers, 8 at a time) against KB keys at a time (packed transposed once per block), only between the
// first and the last key any of its queries may see. The exponentials are torch's own vector exp (SLEEF, to
// 1 ULP, exported by libtorch_cpu). Tasks are ordered so that a causal prompt's cheap and dear query blocks
// alternate: each thread's contiguous share holds about half the work. A query that sees no key gets zeros.
// Without AVX-512 the call is decode_attention's (its portable path: scores, softmax, values, per task).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_args.h"
#include "flash_blocks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QT = 16;  // query tokens a task

#if defined(__AVX512F__)
using flash::KB;
using flash::NEG_INF;

// One task's queries Q (M, D), pre-scaled, against keys [lo, hi) of k/v: O (M, Dv) unnormalised, l (M) sums
template <int D, int NCV>
void attend(const float* Q, int64_t M, const float* k, int64_t kstride, const float* v, int64_t vstride, int64_t lo,
            int64_t hi, int64_t S, const bool* const* visible, float* O, float* l) {
  constexpr int Dv = 16 * NCV;
  constexpr int MBV = NCV >= 8 ? 2 : (NCV >= 4 ? 4 : 8);  // value accumulators: at most 16 vectors
  alignas(64) float Kt[D * KB];
  const float* V[KB];
  std::vector<float> P(M * KB), mrow(M, NEG_INF), corr(M);
  std::fill(O, O + M * Dv, 0.f);
  std::fill(l, l + M, 0.f);
  for (int64_t kb = lo; kb < hi; kb += KB) {
    const int64_t nk = std::min<int64_t>(KB, hi - kb);
    const float* Kr[KB];
    for (int64_t j = 0; j < nk; ++j) {  // the block's key and value rows
      Kr[j] = k + (kb + j) * kstride;
      V[j] = v + (kb + j) * vstride;
    }
    flash::pack_transposed<D / 16>(Kr, nk, Kt);  // transposed, zeros past its end
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) flash::scores<D, 8>(Q, m0, Kt, P.data());
    for (; m0 < M; ++m0) flash::scores<D, 1>(Q, m0, Kt, P.data());
    for (int64_t m = 0; m < M; ++m) {  // mask, online softmax; P becomes the block's weights
      float* pr = P.data() + m * KB;
      __mmask32 keep;  // the block's keys the query sees: the mask's bytes compared 32 at a time
      if (nk == KB && kb + KB <= S) {
        keep = _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(visible[m] + kb)),
                                     _mm256_set1_epi8(1));
      } else {  // the last block of a row: its bytes copied, nothing read past the row
        alignas(32) bool tail[KB] = {false};
        std::copy(visible[m] + kb, visible[m] + kb + nk, tail);
        keep = _mm256_test_epi8_mask(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)), _mm256_set1_epi8(1));
      }
      flash::online_softmax(pr, keep, mrow[m], corr[m], l[m]);
    }
    m0 = 0;
    for (; m0 + MBV <= M; m0 += MBV) flash::values<NCV, MBV>(P.data(), m0, corr.data(), V, nk, O);
    for (; m0 < M; ++m0) flash::values<NCV, 1>(P.data(), m0, corr.data(), V, nk, O);
  }
}

using Attend = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                        const bool* const*, float*, float*);

template <int D>
Attend pick_v(int64_t Dv) {
  switch (Dv) {
    case 32: return attend<D, 2>;
    case 64: return attend<D, 4>;
    case 128: return attend<D, 8>;
    default: return nullptr;
  }
}

Attend pick(int64_t D, int64_t Dv) {
  switch (D) {
    case 32: return pick_v<32>(Dv);
    case 64: return pick_v<64>(Dv);
    case 128: return pick_v<128>(Dv);
    default: return nullptr;
  }
}
#endif

}  // namespace

bool vectorized(int64_t D, int64_t Dv);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask, const torch::Tensor& index, double scale);

// Whether prefill_attention runs (D, Dv): AVX-512 builds, widths 32, 64 or 128 (elsewhere at those builds torch's
// SDPA runs); builds without AVX-512, whatever decode_attention's portable path runs (it answers for them).
bool prefill_vectorized(int64_t D, int64_t Dv) {
#if defined(__AVX512F__)
  return pick(D, Dv) != nullptr;
#else
  return vectorized(D, Dv);
#endif
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& mask, const torch::Tensor& index, double scale) {
#if !defined(__AVX512F__)
  return decode_attention(q, k, v, mask, index, scale);  // its portable path takes any number of queries a row
#endif
  const AttentionArgs a("prefill_attention", q, k, v, mask, index, scale);
  TORCH_CHECK(prefill_vectorized(a.D, a.Dv), "prefill_attention: widths (", a.D, ", ", a.Dv, ") have no vector path");
#if defined(__AVX512F__)
  const int64_t G = a.G, T = a.T, D = a.D, K = a.K, Dv = a.Dv, R = a.R, nqb = (T + QT - 1) / QT;
  const Attend run = pick(D, Dv);
  at::parallel_for(0, nqb * G * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(R * QT * D), O(R * QT * Dv), l(R * QT);
    std::vector<const bool*> visible(R * QT);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t z = u / (G * K), g = (u / K) % G, h = u % K;
      const int64_t qb = z % 2 == 0 ? z / 2 : nqb - 1 - z / 2;  // 0, last, 1, last - 1, ...
      const int64_t t0 = qb * QT, nt = std::min(QT, T - t0), M = R * nt;
      const int64_t slot = a.slot(g);
      int64_t lo, hi;  // the keys any query of the block may see
      a.visible_range(g, t0, t0 + nt, lo, hi);
      for (int64_t r = 0; r < R; ++r)  // query m = r * nt + t: head h * R + r, token t0 + t; scaled once
        for (int64_t t = 0; t < nt; ++t) {
          const float* src = a.query(g, h * R + r, t0 + t);
          float* dst = Q.data() + (r * nt + t) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
          visible[r * nt + t] = a.mask_row(g, t0 + t);
        }
      if (hi > lo)
        run(Q.data(), M, a.keys(h, slot), a.ks2, a.values(h, slot), a.vs2, lo, hi, a.S, visible.data(), O.data(),
            l.data());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t m = r * nt + t;
          const float inv = hi > lo && l[m] > 0.f ? 1.f / l[m] : 0.f;
          float* dst = a.output(g, t0 + t, h * R + r);
          for (int64_t d = 0; d < Dv; ++d) dst[d] = hi > lo ? O[m * Dv + d] * inv : 0.f;
        }
    }
  });
#endif
  return a.result();
}
