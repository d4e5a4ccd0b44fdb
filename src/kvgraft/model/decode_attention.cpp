// Decode-step attention over paged keys/values read in place, for the CPU (float32).
//
// decode_attention(q, k, v, mask, index, scale) -> (G, H, T, Dv)
//   q     (G, H, T, D)   the group's queries (T new tokens per row)
//   k     (K, n, S, D)   keys of K heads for n slots, any strides but the last (views of the pools' home runs)
//   v     (K, n, S, Dv)  values, laid out as k
//   mask  (G, T, S)      bool, true = the query attends the key
//   index (G,) int64     the slot of each row among the n (empty: row g is slot g)
// Query head h reads key head h / (H / K). Each (row, key head) pair is one task: its keys are read once
// for the scores of its H/K * T queries, its values once for their sum, and only between the first and
// the last key any of its queries may see, so a row never pays for a longer row's keys. Scores and the
// softmax are float32; a query that sees no key gets zeros.
#include "vec_blocks.h"  // first: it sets the vector width of ATen's headers (the portable path's)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_args.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QB = 4;   // queries whose accumulators stay in registers while one key (or value) is read
constexpr int64_t PF = 16;  // keys read ahead (software prefetch)

// scores[m * L + s] = q_m . k_s for queries [m0, m0 + mb) and keys [0, L)
template <int NC>
void scores_block(const float* q, int64_t D, int64_t m0, int64_t mb, const float* k, int64_t kstride, int64_t L,
                  float* scores) {
#if defined(__AVX512F__)
  if (NC > 0) {
    __m512 qv[QB][NC > 0 ? NC : 1];
    for (int64_t i = 0; i < mb; ++i)
      for (int c = 0; c < NC; ++c) qv[i][c] = _mm512_loadu_ps(q + (m0 + i) * D + 16 * c);
    for (int64_t s = 0; s < L; ++s) {
      const float* kr = k + s * kstride;
      for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(kr + PF * kstride + 16 * c), _MM_HINT_T0);
      __m512 kv[NC > 0 ? NC : 1];
      for (int c = 0; c < NC; ++c) kv[c] = _mm512_loadu_ps(kr + 16 * c);
      for (int64_t i = 0; i < mb; ++i) {
        __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[i][c], kv[c], acc);
        scores[(m0 + i) * L + s] = _mm512_reduce_add_ps(acc);
      }
    }
    return;
  }
#endif
  for (int64_t s = 0; s < L; ++s) {  // any width: ATen's Vectorized<float> at the build's width
    const float* kr = k + s * kstride;
    for (int64_t i = 0; i < mb; ++i) scores[(m0 + i) * L + s] = vecb::dot(q + (m0 + i) * D, kr, D);
  }
}

// acc[m * Dv + d] = sum_s p[m * L + s] * v_s[d] for queries [m0, m0 + mb)
template <int NC>
void values_block(const float* p, int64_t L, int64_t m0, int64_t mb, const float* v, int64_t vstride, int64_t Dv,
                  float* acc) {
#if defined(__AVX512F__)
  if (NC > 0) {
    __m512 av[QB][NC > 0 ? NC : 1];
    for (int64_t i = 0; i < mb; ++i)
      for (int c = 0; c < NC; ++c) av[i][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < L; ++s) {
      const float* vr = v + s * vstride;
      for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(vr + PF * vstride + 16 * c), _MM_HINT_T0);
      __m512 vv[NC > 0 ? NC : 1];
      for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int64_t i = 0; i < mb; ++i) {
        const __m512 pw = _mm512_set1_ps(p[(m0 + i) * L + s]);
        for (int c = 0; c < NC; ++c) av[i][c] = _mm512_fmadd_ps(pw, vv[c], av[i][c]);
      }
    }
    for (int64_t i = 0; i < mb; ++i)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (m0 + i) * Dv + 16 * c, av[i][c]);
    return;
  }
#endif
  for (int64_t i = 0; i < mb; ++i) std::fill(acc + (m0 + i) * Dv, acc + (m0 + i + 1) * Dv, 0.f);
  for (int64_t s = 0; s < L; ++s) {
    const float* vr = v + s * vstride;
    for (int64_t i = 0; i < mb; ++i) {
      const float w = p[(m0 + i) * L + s];
      if (w != 0.f) vecb::axpy(w, vr, acc + (m0 + i) * Dv, Dv);
    }
  }
}

template <int NCK, int NCV>
void run_blocks(const float* q, int64_t D, int64_t M, const float* k, int64_t kstride, const float* v, int64_t vstride,
                int64_t Dv, int64_t L, float* scores, const bool* const* visible, float* acc, float* denom) {
  for (int64_t m0 = 0; m0 < M; m0 += QB) scores_block<NCK>(q, D, m0, std::min(QB, M - m0), k, kstride, L, scores);
  for (int64_t m = 0; m < M; ++m) {  // softmax over the visible keys, in place
    float* sr = scores + m * L;
    const bool* vis = visible[m];
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < L; ++s)
      if (vis[s]) mx = std::max(mx, sr[s]);
    float sum = 0.f;
    for (int64_t s = 0; s < L; ++s) {
      sr[s] = vis[s] ? std::exp(sr[s] - mx) : 0.f;
      sum += sr[s];
    }
    denom[m] = sum;
  }
  for (int64_t m0 = 0; m0 < M; m0 += QB) values_block<NCV>(scores, L, m0, std::min(QB, M - m0), v, vstride, Dv, acc);
}

using Runner = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                        float*, const bool* const*, float*, float*);

template <int NCK>
Runner pick_v(int64_t Dv) {
#if defined(__AVX512F__)
  switch (Dv) {
    case 32: return run_blocks<NCK, 2>;
    case 64: return run_blocks<NCK, 4>;
    case 128: return run_blocks<NCK, 8>;
    default: break;
  }
#endif
  return run_blocks<NCK, 0>;
}

Runner pick(int64_t D, int64_t Dv) {
#if defined(__AVX512F__)
  switch (D) {
    case 32: return pick_v<2>(Dv);
    case 64: return pick_v<4>(Dv);
    case 128: return pick_v<8>(Dv);
    case 192: return pick_v<12>(Dv);
    default: break;
  }
#endif
  return pick_v<0>(Dv);
}

bool vectorized_width(int64_t d) { return d == 32 || d == 64 || d == 128; }

}  // namespace

// Whether (D, Dv) run on a vector path: AVX-512 builds, key width 32/64/128/192 and value width 32/64/128 (the
// tuned path; other widths there run the portable loop, slower than torch's batched matmuls); builds without
// AVX-512, any widths (the portable loop on ATen's Vectorized<float>, AVX2 or plain C++).
bool vectorized(int64_t D, int64_t Dv) {
#if defined(__AVX512F__)
  return (vectorized_width(D) || D == 192) && vectorized_width(Dv);
#else
  return D > 0 && Dv > 0;
#endif
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask, const torch::Tensor& index, double scale) {
  const AttentionArgs a("decode_attention", q, k, v, mask, index, scale);
  const int64_t G = a.G, T = a.T, D = a.D, K = a.K, Dv = a.Dv, R = a.R, M = R * T;
  const Runner runner = pick(D, Dv);
  at::parallel_for(0, G * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(M * D), scores, acc(M * Dv), denom(M);
    std::vector<const bool*> visible(M);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / K, h = u % K;
      const int64_t slot = a.slot(g);
      int64_t lo, hi;  // the keys any query of the row may see
      a.visible_range(g, 0, T, lo, hi);
      const int64_t L = hi > lo ? hi - lo : 0;
      for (int64_t r = 0; r < R; ++r)  // query m = r * T + t: head h * R + r, token t; scaled once
        for (int64_t t = 0; t < T; ++t) {
          const float* src = a.query(g, h * R + r, t);
          float* dst = qbuf.data() + (r * T + t) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
        }
      if (L == 0) {
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(denom.begin(), denom.end(), 1.f);
      } else {
        scores.resize(M * L);
        for (int64_t m = 0; m < M; ++m) visible[m] = a.mask_row(g, m % T) + lo;
        runner(qbuf.data(), D, M, a.keys(h, slot) + lo * a.ks2, a.ks2, a.values(h, slot) + lo * a.vs2, a.vs2, Dv, L,
               scores.data(), visible.data(), acc.data(), denom.data());
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t m = r * T + t;
          const float inv = denom[m] > 0.f ? 1.f / denom[m] : 0.f;
          float* dst = a.output(g, t, h * R + r);
          for (int64_t d = 0; d < Dv; ++d) dst[d] = acc[m * Dv + d] * inv;
        }
    }
  });
  return a.result();
}
