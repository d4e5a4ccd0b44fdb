// A whole step's attention over the paged GQA pools, for the CPU (float32, AVX-512): every row of the step
// (decode rows and prompt chunks, each with its own number of new tokens) in one call, each row's keys read
// in place through its block table, the causal (and window) visibility worked out from positions, no mask.
//
// paged_attention(q, pool, tables, rows, window, scale) -> (N, H, D), token-major
//   q      (N, H, D)       the step's queries on the packed token axis, any strides but the last
//   pool   (2K, B, bs, D)  the layer's pool: K key heads then their K value heads, contiguous
//   tables (rows, nb)      int64 block ids of each row (entries past a row's keys are never read)
//   rows   (rows, 3)       int64 per row: its first token on the packed axis, its new tokens T, its keys
//                          before the step (its first query's position); its keys [0, start + T) are in the pool
//   window                 0: every earlier key visible; W: a query at p sees keys (p - W, p]
// Query head h reads key head h / (H / K). A task is (row, key head, up to QT query tokens): a decode token's
// H/K queries read their keys once for the scores (16 keys a batch, their dot products summed by one transposing
// tree, the next batch's keys and this batch's values prefetched), once for the sum (the scores of all keys
// kept); a prompt chunk's queries run flash-style (KB keys at a time, packed transposed in registers, the next
// block prefetched, an online softmax). Threads take tasks dearest first (queries x keys) from a shared counter.
// The exponentials are torch's own vector exp (SLEEF). That tuned form is AVX-512's; a build without AVX-512 (AVX2,
// or none) runs a portable form on ATen's Vectorized<float> (vec_blocks.h): each task's scores key by key, a
// softmax, then the weighted values.
#include "vec_blocks.h"  // first: it sets the vector width of ATen's headers (the portable path's)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "flash_blocks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>  // (AVX-512: Sleef_expf16_u10, torch's vector exp, is declared in flash_blocks.h)
#endif

namespace {

// What every task reads: the pool's addressing and each row's table.
struct Pool {
  const float* base;
  int64_t head_stride, block_stride, bs, K;
  const int64_t* tables;
  int64_t nb;
  // key (h < K) or value (h >= K) row of head h at position p of row r
  const float* row(int64_t r, int64_t h, int64_t p) const {
    return base + h * head_stride + tables[r * nb + p / bs] * block_stride + (p % bs) * (block_stride / bs);
  }
  // how many of row r's positions from p (up to hi) lie in one stretch of memory: to the end of p's block, and
  // on through every next block whose id follows (a row in consecutive blocks, as at its slot's home, is one)
  int64_t run(int64_t r, int64_t p, int64_t hi) const {
    const int64_t* t = tables + r * nb;
    int64_t end = std::min(hi, (p / bs + 1) * bs);
    while (end < hi && t[end / bs] == t[end / bs - 1] + 1) end = std::min(hi, end + bs);
    return end - p;
  }
};

struct Task {
  int64_t row, t0, nt, head, cost;
};

// The tasks of a step: (row, up to QT of its tokens, key head), dearest first (queries x keys)
constexpr int64_t QT = 16;  // query tokens a prompt task

std::vector<Task> step_tasks(const int64_t* rows, int64_t nrows, int64_t window, int64_t K, int64_t R) {
  std::vector<Task> tasks;
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t T = rows[r * 3 + 1], start = rows[r * 3 + 2];
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t nt = std::min(QT, T - t0), last = start + t0 + nt;  // keys [lo, last) seen by the block
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + t0 - window + 1) : 0;
      for (int64_t h = 0; h < K; ++h) tasks.push_back({r, t0, nt, h, R * nt * (last - lo) + 64});
    }
  }
  // dearest first, each thread taking the next task as it finishes one (a cost estimate alone balanced badly:
  // a decode task reads its keys from memory, a prompt task's are reused by 16 queries)
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// Every task of a step through a worker (``make()`` gives each thread its own, with its scratch), threads taking
// tasks dearest first from a shared counter: a task's queries gathered and scaled (query m = rr * nt + j: head
// h R + rr, token t0 + j), its keys' range [lo, hi), then ``work(pool, row, head, Q, M, pos, lo, hi, D, O)`` and its
// output rows written token-major.
template <class Make>
void run_tasks(const torch::Tensor& q, const Pool& pool, const int64_t* rows, int64_t nrows, int64_t window,
               float scale, float* out, int64_t H, int64_t D, Make make) {
  const int64_t K = pool.K, R = H / K;
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const std::vector<Task> tasks = step_tasks(rows, nrows, window, K, R);
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nth, 1, [&](int64_t begin, int64_t end) {
    auto work = make();
    std::vector<float> Q(R * QT * D), O(R * QT * D);
    std::vector<int64_t> pos(R * QT);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next++; i < n; i = next++) {
        const Task& t = tasks[i];
        const int64_t off = rows[t.row * 3], start = rows[t.row * 3 + 2], M = R * t.nt;
        for (int64_t rr = 0; rr < R; ++rr)
          for (int64_t j = 0; j < t.nt; ++j) {
            const float* src = qp + (off + t.t0 + j) * qs0 + (t.head * R + rr) * qs1;
            float* dst = Q.data() + (rr * t.nt + j) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
            pos[rr * t.nt + j] = start + t.t0 + j;
          }
        const int64_t first = start + t.t0, hi = first + t.nt;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
        work(t, Q.data(), M, pos.data(), lo, hi, O.data());
        for (int64_t rr = 0; rr < R; ++rr)
          for (int64_t j = 0; j < t.nt; ++j)
            std::copy_n(O.data() + (rr * t.nt + j) * D, D, out + ((off + t.t0 + j) * H + t.head * R + rr) * D);
      }
  });
}

#if defined(__AVX512F__)
constexpr int64_t QB = 4;   // decode queries whose accumulators stay in registers while one key is read
using flash::KB;
using flash::NEG_INF;

// ---- decode: a few queries at one position against keys [lo, hi) ----------------------------------------------
// v[j] = the sum of a[j]'s 16 lanes, for 16 vectors at once (a transposing tree: 45 shuffles and adds for the 16
// sums, where one horizontal sum a vector takes about 8 dependent ones). The sums' rounding order: lanes (i, i+2)
// of each 128-bit quarter, then the quarter's two pairs, then quarters (0, 1) and (2, 3), then the halves.
struct Sum16 {
  __m512 l1[8];
  // a[2i], a[2i+1] -> their lanes added in pairs, interleaved (unpack: [x0+x2, y0+y2, x1+x3, y1+y3] a quarter)
  inline void pair(int i, __m512 x, __m512 y) {
    l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  inline __m512 quad(int i) const {  // a[4i..4i+3]: each quarter holds its four vectors' sums over that quarter
    const __m512d x = _mm512_castps_pd(l1[2 * i]), y = _mm512_castps_pd(l1[2 * i + 1]);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  inline __m512 sums() const {
    const __m512 q0 = quad(0), q1 = quad(1), q2 = quad(2), q3 = quad(3);
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(q2, q3, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(q2, q3, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};

// q_m . k for one query's vectors qv and one key row kr (a vector of partial sums, lanes still to add)
template <int NC>
inline __m512 dot_lanes(const __m512* qv, const float* kr) {
  __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
  for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
  return acc;
}

// S[m * L + s] = q_m . k_s for queries [m0, m0 + mb), keys [0, n) contiguous at k (stride D): 16 keys at a time
// (their 16 dot products summed by one Sum16), the last n % 16 one by one
template <int NC>
inline void dec_scores(const float* q, int64_t m0, int64_t mb, const float* k, int64_t n, float* S, int64_t L) {
  constexpr int D = 16 * NC;
  __m512 qv[QB][NC];
  for (int64_t i = 0; i < mb; ++i)
    for (int c = 0; c < NC; ++c) qv[i][c] = _mm512_loadu_ps(q + (m0 + i) * D + 16 * c);
  int64_t s = 0;
  for (; s + 16 <= n; s += 16) {
    const float* kb = k + s * D;
    for (int64_t i = 0; i < mb; ++i) {
      Sum16 t;
      for (int j = 0; j < 8; ++j)
        t.pair(j, dot_lanes<NC>(qv[i], kb + (2 * j) * D), dot_lanes<NC>(qv[i], kb + (2 * j + 1) * D));
      _mm512_storeu_ps(S + (m0 + i) * L + s, t.sums());
    }
  }
  for (; s < n; ++s) {
    const float* kr = k + s * D;
    for (int64_t i = 0; i < mb; ++i) S[(m0 + i) * L + s] = _mm512_reduce_add_ps(dot_lanes<NC>(qv[i], kr));
  }
}

// A[m] += sum_s P[m * L + s] v_s for queries [m0, m0 + mb), values [0, n) contiguous at v (stride D)
template <int NC>
inline void dec_values(const float* P, int64_t L, int64_t m0, int64_t mb, const float* v, int64_t n, float* A) {
  constexpr int D = 16 * NC;
  __m512 av[QB][NC];
  for (int64_t i = 0; i < mb; ++i)
    for (int c = 0; c < NC; ++c) av[i][c] = _mm512_loadu_ps(A + (m0 + i) * D + 16 * c);
  for (int64_t s = 0; s < n; ++s) {
    const float* vr = v + s * D;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int64_t i = 0; i < mb; ++i) {
      const __m512 pw = _mm512_set1_ps(P[(m0 + i) * L + s]);
      for (int c = 0; c < NC; ++c) av[i][c] = _mm512_fmadd_ps(pw, vv[c], av[i][c]);
    }
  }
  for (int64_t i = 0; i < mb; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(A + (m0 + i) * D + 16 * c, av[i][c]);
}

// ask the memory for the n floats at x, a cache line at a time (no wait)
inline void prefetch(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(x + i), _MM_HINT_T0);
}

// ask the memory for the rows of head h (keys h < K, values h >= K) at row r's positions [p, e)
template <int D>
inline void prefetch_positions(const Pool& pool, int64_t r, int64_t h, int64_t p, int64_t e) {
  while (p < e) {
    const int64_t n = pool.run(r, p, e);
    prefetch(pool.row(r, h, p), n * D);
    p += n;
  }
}

// M pre-scaled queries Q (M, D) of row r, head h, all at one position, against its keys [lo, hi): O (M, D)
// normalised. S: scratch of M * (hi - lo) scores.
template <int NC>
void decode_task(const Pool& pool, int64_t r, int64_t h, const float* Q, int64_t M, int64_t lo, int64_t hi,
                 std::vector<float>& S, float* O) {
  constexpr int D = 16 * NC;
  const int64_t L = hi - lo;
  std::fill(O, O + M * D, 0.f);
  if (L <= 0) return;
  S.resize(M * L);
  // the keys a stretch of consecutive blocks at a time, 16 keys a batch; meanwhile the memory is asked for the
  // next batch's keys and this batch's values (a row's keys are too short a stream for the CPU's own prefetcher:
  // measured 1.3-1.5x faster decode rows with these)
  int64_t n = pool.run(r, lo, hi);
  const float* k = pool.row(r, h, lo);
  prefetch(k, std::min<int64_t>(n, 16) * D);
  for (int64_t p = lo; p < hi;) {
    const float* v = pool.row(r, pool.K + h, p);
    // the stretch after this one (its first 16 keys prefetched as this one's last batch runs)
    const int64_t p2 = p + n, n2 = p2 < hi ? pool.run(r, p2, hi) : 0;
    const float* k2 = p2 < hi ? pool.row(r, h, p2) : nullptr;
    for (int64_t b = 0; b < n; b += 16) {
      const int64_t nb = std::min<int64_t>(16, n - b);
      prefetch(v + b * D, nb * D);
      if (b + 16 < n)
        prefetch(k + (b + 16) * D, std::min<int64_t>(16, n - b - 16) * D);
      else if (k2 != nullptr)
        prefetch(k2, std::min<int64_t>(16, n2) * D);
      for (int64_t m0 = 0; m0 < M; m0 += QB)
        dec_scores<NC>(Q, m0, std::min(QB, M - m0), k + b * D, nb, S.data() + (p + b - lo), L);
    }
    p = p2, n = n2, k = k2;
  }
  for (int64_t m = 0; m < M; ++m) {  // softmax in place (every key of the range is visible)
    float* sr = S.data() + m * L;
    float mx = NEG_INF;
    for (int64_t s = 0; s < L; ++s) mx = std::max(mx, sr[s]);
    float sum = 0.f;
    int64_t s = 0;
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (; s + 16 <= L; s += 16) {
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(sr + s), mv));
      _mm512_storeu_ps(sr + s, e);
      acc = _mm512_add_ps(acc, e);
    }
    if (s < L) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (L - s)) - 1);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + s), mv));
      _mm512_mask_storeu_ps(sr + s, tail, e);
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
    }
    sum = _mm512_reduce_add_ps(acc);
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < L; ++j) sr[j] *= inv;
  }
  for (int64_t p = lo; p < hi;) {
    const int64_t n = pool.run(r, p, hi);
    const float* v = pool.row(r, pool.K + h, p);
    for (int64_t m0 = 0; m0 < M; m0 += QB) dec_values<NC>(S.data() + (p - lo), L, m0, std::min(QB, M - m0), v, n, O);
    p += n;
  }
}

// ---- prompt chunks: flash-style ---------------------------------------------------------------------------------
// bits j of [a, b) set, j < 32
inline __mmask32 span_bits(int64_t a, int64_t b) {
  if (b <= a) return 0;
  const uint64_t hi = (uint64_t{1} << b) - 1, lo = (uint64_t{1} << a) - 1;
  return static_cast<__mmask32>(hi & ~lo);
}

// M pre-scaled queries Q (M, D) of row r, head h; query m's position pos[m]; keys [lo, hi): O (M, D) normalised
template <int NC>
void flash_task(const Pool& pool, int64_t r, int64_t h, const float* Q, int64_t M, const int64_t* pos, int64_t window,
                int64_t lo, int64_t hi, std::vector<float>& P, std::vector<float>& scratch, float* O) {
  constexpr int D = 16 * NC;
  constexpr int MBV = NC >= 8 ? 2 : (NC >= 4 ? 4 : 8);  // value accumulators: at most 16 vectors
  alignas(64) float Kt[D * KB];
  const float* V[KB];
  P.resize(M * KB);
  scratch.resize(3 * M);
  float *mrow = scratch.data(), *corr = mrow + M, *l = corr + M;
  std::fill(mrow, mrow + M, NEG_INF);
  std::fill(l, l + M, 0.f);
  std::fill(O, O + M * D, 0.f);
  const float* Kr[KB];
  for (int64_t kb = lo; kb < hi; kb += KB) {
    const int64_t nk = std::min<int64_t>(KB, hi - kb);
    for (int64_t j = 0; j < nk;) {  // the block's key and value rows, a stretch of consecutive blocks at a time
      const int64_t n = pool.run(r, kb + j, kb + nk);
      const float *k0 = pool.row(r, h, kb + j), *v0 = pool.row(r, pool.K + h, kb + j);
      for (int64_t i = 0; i < n; ++i) Kr[j + i] = k0 + i * D, V[j + i] = v0 + i * D;
      j += n;
    }
    if (kb + KB < hi) {  // the next block's keys and values asked for while this one is worked on
      const int64_t e = std::min<int64_t>(hi, kb + 2 * KB);
      prefetch_positions<D>(pool, r, h, kb + KB, e);
      prefetch_positions<D>(pool, r, pool.K + h, kb + KB, e);
    }
    flash::pack_transposed<NC>(Kr, nk, Kt);
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) flash::scores<D, 8>(Q, m0, Kt, P.data());
    for (; m0 < M; ++m0) flash::scores<D, 1>(Q, m0, Kt, P.data());
    for (int64_t m = 0; m < M; ++m) {  // visibility from positions, online softmax; P becomes the weights
      float* pr = P.data() + m * KB;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos[m] - window + 1) : 0;
      const __mmask32 keep = span_bits(std::max<int64_t>(first - kb, 0), std::min<int64_t>(pos[m] + 1 - kb, nk));
      flash::online_softmax(pr, keep, mrow[m], corr[m], l[m]);
    }
    m0 = 0;
    for (; m0 + MBV <= M; m0 += MBV) flash::values<NC, MBV>(P.data(), m0, corr, V, nk, O);
    for (; m0 < M; ++m0) flash::values<NC, 1>(P.data(), m0, corr, V, nk, O);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = l[m] > 0.f ? 1.f / l[m] : 0.f;
    for (int d = 0; d < D; ++d) O[m * D + d] *= inv;
  }
}

template <int NC>
void run(const torch::Tensor& q, const Pool& pool, const int64_t* rows, int64_t nrows, int64_t window, float scale,
         float* out, int64_t H) {
  run_tasks(q, pool, rows, nrows, window, scale, out, H, 16 * NC, [&]() {
    return [&pool, window, S = std::vector<float>(), P = std::vector<float>(), scratch = std::vector<float>()](
               const Task& t, const float* Q, int64_t M, const int64_t* pos, int64_t lo, int64_t hi, float* O) mutable {
      if (t.nt == 1)
        decode_task<NC>(pool, t.row, t.head, Q, M, lo, hi, S, O);
      else
        flash_task<NC>(pool, t.row, t.head, Q, M, pos, window, lo, hi, P, scratch, O);
    };
  });
}
#else
// ---- portable: ATen's Vectorized<float> (AVX2 or plain C++), one plain task form --------------------------------
#if defined(__AVX2__) && defined(__FMA__)
// AVX2 (eight floats a vector), for widths that are a multiple of 8: a key's dot products are summed 8 keys at a time
// by one transposing tree (a horizontal sum each took about as long as the key's 8 products at width 64), and the
// values' sums kept in registers over a batch of keys (not loaded and stored a key at a time).
inline __m256 sum8(const __m256 a[8]) {  // lane j: the sum of a[j]'s 8 lanes
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// S[m * L + s] = Q_m . k_s for queries [0, M) and keys [0, n) contiguous at k (stride D)
inline void scores8(const float* Q, int64_t M, int64_t D, const float* k, int64_t n, float* S, int64_t L) {
  int64_t s = 0;
  for (; s + 8 <= n; s += 8)
    for (int64_t m = 0; m < M; ++m) {
      const float* q = Q + m * D;
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (s + j) * D + c), a[j]);
      }
      _mm256_storeu_ps(S + m * L + s, sum8(a));
    }
  for (; s < n; ++s)
    for (int64_t m = 0; m < M; ++m) S[m * L + s] = vecb::dot(Q + m * D, k + s * D, D);
}

// O_m[c0, c0 + 8 NC) += sum_s P[m * L + s] v_s[c0, ...) for queries [0, M), values [0, n) contiguous at v (stride D):
// 32 values a batch (they stay in the first-level cache while each query's NC accumulators run over them)
template <int NC>
inline void values8(const float* P, int64_t L, int64_t M, int64_t D, int64_t c0, const float* v, int64_t n, float* O) {
  for (int64_t b = 0; b < n; b += 32) {
    const int64_t e = std::min<int64_t>(n, b + 32);
    for (int64_t m = 0; m < M; ++m) {
      __m256 acc[NC];
      float* o = O + m * D + c0;
      for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
      for (int64_t s = b; s < e; ++s) {
        const __m256 w = _mm256_set1_ps(P[m * L + s]);
        const float* vr = v + s * D + c0;
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
      }
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
    }
  }
}
#endif

// M pre-scaled queries Q (M, D) of row r, head h, query m at position pos[m], against keys [lo, hi): every score
// (keys a query does not see: -inf), a softmax per query, the weighted values; O (M, D) normalised. Each key row is
// read once for all M queries' scores, each value row once for their sums (a batch of them, on AVX2).
void task(const Pool& pool, int64_t r, int64_t h, const float* Q, int64_t M, const int64_t* pos, int64_t window,
          int64_t lo, int64_t hi, int64_t D, std::vector<float>& S, float* O) {
  const int64_t L = hi - lo;
  S.resize(M * L);
  std::fill(O, O + M * D, 0.f);
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t p = lo; p < hi;) {
      const int64_t n = pool.run(r, p, hi);
      scores8(Q, M, D, pool.row(r, h, p), n, S.data() + (p - lo), L);
      p += n;
    }
    for (int64_t m = 0; m < M; ++m) {  // the keys a query does not see (a prompt chunk's later keys, a window's edge)
      const int64_t first = window > 0 ? std::max(lo, pos[m] - window + 1) : lo, last = std::min(hi, pos[m] + 1);
      float* sm = S.data() + m * L;
      std::fill(sm, sm + std::max<int64_t>(first - lo, 0), -std::numeric_limits<float>::infinity());
      if (last < hi) std::fill(sm + (last - lo), sm + L, -std::numeric_limits<float>::infinity());
      vecb::softmax(sm, L);
    }
    for (int64_t p = lo; p < hi;) {
      const int64_t n = pool.run(r, p, hi);
      const float* v = pool.row(r, pool.K + h, p);
      for (int64_t c0 = 0; c0 < D; c0 += 64) {
        const float* P = S.data() + (p - lo);
        switch (std::min<int64_t>(64, D - c0) / 8) {
          case 8: values8<8>(P, L, M, D, c0, v, n, O); break;
          case 4: values8<4>(P, L, M, D, c0, v, n, O); break;
          case 2: values8<2>(P, L, M, D, c0, v, n, O); break;
          case 1: values8<1>(P, L, M, D, c0, v, n, O); break;
          case 7: values8<7>(P, L, M, D, c0, v, n, O); break;
          case 6: values8<6>(P, L, M, D, c0, v, n, O); break;
          case 5: values8<5>(P, L, M, D, c0, v, n, O); break;
          default: values8<3>(P, L, M, D, c0, v, n, O); break;
        }
      }
      p += n;
    }
    return;
  }
#endif
  for (int64_t p = lo; p < hi;) {
    const int64_t n = pool.run(r, p, hi);
    const float* k = pool.row(r, h, p);
    for (int64_t s = 0; s < n; ++s)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t kp = p + s;
        const bool seen = kp <= pos[m] && (window == 0 || kp > pos[m] - window);
        S[m * L + kp - lo] = seen ? vecb::dot(Q + m * D, k + s * D, D) : -std::numeric_limits<float>::infinity();
      }
    p += n;
  }
  for (int64_t m = 0; m < M; ++m) vecb::softmax(S.data() + m * L, L);
  for (int64_t p = lo; p < hi;) {
    const int64_t n = pool.run(r, p, hi);
    const float* v = pool.row(r, pool.K + h, p);
    for (int64_t s = 0; s < n; ++s)
      for (int64_t m = 0; m < M; ++m) {
        const float w = S[m * L + p + s - lo];
        if (w != 0.f) vecb::axpy(w, v + s * D, O + m * D, D);
      }
    p += n;
  }
}

void run_portable(const torch::Tensor& q, const Pool& pool, const int64_t* rows, int64_t nrows, int64_t window,
                  float scale, float* out, int64_t H, int64_t D) {
  run_tasks(q, pool, rows, nrows, window, scale, out, H, D, [&]() {
    return [&pool, window, D, S = std::vector<float>()](const Task& t, const float* Q, int64_t M, const int64_t* pos,
                                                         int64_t lo, int64_t hi, float* O) mutable {
      task(pool, t.row, t.head, Q, M, pos, window, lo, hi, D, S, O);
    };
  });
}
#endif

}  // namespace

// Whether paged_attention runs head width D: AVX-512 builds D 32, 64 or 128 (the tuned path), others any D (the
// portable path)
bool paged_vectorized(int64_t D) {
#if defined(__AVX512F__)
  return D == 32 || D == 64 || D == 128;
#else
  return D > 0;  // the portable path: any width
#endif
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                              const torch::Tensor& rows, int64_t window, double scale) {
  const char* fn = "paged_attention";
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 4 && tables.dim() == 2 && rows.dim() == 2 && rows.size(1) == 3, fn,
              ": q (N, H, D), pool (2K, B, bs, D), tables (rows, nb), rows (rows, 3)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat && q.device().is_cpu() &&
                  pool.device().is_cpu(),
              fn, ": float32 CPU tensors");
  TORCH_CHECK(tables.scalar_type() == at::kLong && rows.scalar_type() == at::kLong, fn, ": int64 tables and rows");
  TORCH_CHECK(pool.is_contiguous(), fn, ": a contiguous pool");
  TORCH_CHECK(window >= 0, fn, ": window >= 0");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), K2 = pool.size(0), B = pool.size(1), bs = pool.size(2);
  TORCH_CHECK(K2 % 2 == 0 && K2 > 0 && H % (K2 / 2) == 0, fn, ": the pool's key heads must divide the query heads");
  TORCH_CHECK(pool.size(3) == D, fn, ": the pool's head width (", pool.size(3), ") differs from the queries' (", D, ")");
  TORCH_CHECK(tables.size(0) == rows.size(0), fn, ": one table per row");
  TORCH_CHECK(paged_vectorized(D), fn, ": head width ", D, " has no vector path");
  const torch::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const torch::Tensor tc = tables.contiguous(), rc = rows.contiguous();
  const int64_t nrows = rc.size(0), nb = tc.size(1);
  const int64_t* rp = rc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  int64_t covered = 0;  // the rows tile the step in order, their keys inside their tables, their blocks in the pool
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t off = rp[r * 3], T = rp[r * 3 + 1], start = rp[r * 3 + 2], end = start + T;
    TORCH_CHECK(T >= 1 && off == covered && off + T <= N && start >= 0, fn, ": row ", r, " (offset ", off, ", tokens ",
                T, ", start ", start, ") does not follow the rows before it on the step's ", N, " queries");
    TORCH_CHECK(end <= nb * bs, fn, ": row ", r, " needs ", end, " keys; its table holds ", nb * bs);
    for (int64_t b = 0; b < (end + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[r * nb + b] >= 0 && tp[r * nb + b] < B, fn, ": row ", r, " block ", tp[r * nb + b],
                  " outside the pool's ", B);
    covered += T;
  }
  TORCH_CHECK(covered == N, fn, ": the rows cover ", covered, " of the step's ", N, " queries");
  torch::Tensor out = torch::empty({N, H, D}, q.options());  // every query written once: the rows tile the step
  const Pool pl{pool.data_ptr<float>(), pool.stride(0), pool.stride(1), bs, K2 / 2, tp, nb};
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  switch (D) {
    case 32: run<2>(qc, pl, rp, nrows, window, sc, out.data_ptr<float>(), H); break;
    case 64: run<4>(qc, pl, rp, nrows, window, sc, out.data_ptr<float>(), H); break;
    default: run<8>(qc, pl, rp, nrows, window, sc, out.data_ptr<float>(), H); break;
  }
#else
  run_portable(qc, pl, rp, nrows, window, sc, out.data_ptr<float>(), H, D);
#endif
  return out;
}
