// One-pass CPU forms of a decoder layer's elementwise work (float32, inference), each one op where torch runs
// five (RMSNorm), six (a residual add then RMSNorm), nine (rotary embedding, rotate-half) or three (SwiGLU's
// silu and product, and the copy the next matmul makes of their strided result).
//
// rope is bit-identical to kvgraft.model.rope.apply_rope (the same two products and one sum, each rounded: the
// build keeps the compiler from contracting them into fused multiply-adds);
// rms_norm and add_rms_norm differ from kvgraft.model.norm.RMSNorm only in the order the sum of squares is
// accumulated (the residual sum itself is exact as torch's).
#include "vec_blocks.h"  // first: it sets the vector width of ATen's headers (silu_mul's path without AVX-512)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's vector exp, exported by libtorch_cpu
#endif

namespace {

// an empty tensor with x's sizes whose memory follows x's stride order (as torch's elementwise ops allocate)
torch::Tensor empty_in_order(const torch::Tensor& x) {
  const int64_t n = x.dim();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> sizes(n), inverse(n);
  for (int64_t i = 0; i < n; ++i) sizes[i] = x.size(order[i]), inverse[order[i]] = i;
  return torch::empty(sizes, x.options()).permute(inverse);
}

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), what, ": float32 CPU tensors only");
}

// one row of RMSNorm: o = w * (x * rsqrt(mean(x^2) + eps))
inline void norm_row(const float* xr, const float* wp, float* orow, int64_t h, float e) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += xr[i + j] * xr[i + j];
  float ss = 0.f;
  for (int j = 0; j < 16; ++j) ss += lanes[j];
  for (; i < h; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + e);
  for (int64_t k = 0; k < h; ++k) {
    const float n = xr[k] * inv;
    orow[k] = wp[k] * n;
  }
}

}  // namespace

// gu (..., 2 f): [gate | up] as one matmul gives them, rows at any stride -> (..., f) silu(gate) * up, contiguous.
// silu(g) = g / (1 + exp(-g)), the formula and the exp (SLEEF, 1 ULP) of torch's own vectorised silu; each
// product and quotient rounded as torch's two ops round them.
torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_float(gu, "silu_mul");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0 && gu.stride(-1) == 1, "silu_mul: [gate | up] rows, unit stride");
  const int64_t f = gu.size(-1) / 2;
  const auto rows2 = gu.reshape({-1, 2 * f});  // a view for one matmul's output (rows at one stride)
  const int64_t rows = rows2.size(0), rs = rows2.stride(0);
  std::vector<int64_t> sizes(gu.sizes().begin(), gu.sizes().end());
  sizes.back() = f;
  auto out = torch::empty(sizes, gu.options());
  const float* gp = rows2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * rs;
      const float* u = g + f;
      float* o = op + r * f;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= f; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
      }
#else
      using vecb::Vec;  // ATen's Vectorized<float> at the build's width (AVX2 or plain C++): torch's formula and exp
      for (; i + vecb::VL <= f; i += vecb::VL) {
        const Vec x = Vec::loadu(g + i);
        ((x / (Vec(1.f) + x.neg().exp())) * Vec::loadu(u + i)).store(o + i);
      }
#endif
      for (; i < f; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
  return out;
}

// x (..., h), weight (h,) -> weight * (x * rsqrt(mean(x^2) + eps))
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_float(x, "rms_norm");
  check_float(weight, "rms_norm");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.numel() == h, "rms_norm: weight of ", weight.numel(), " for rows of ", h);
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = xc.numel() / std::max<int64_t>(h, 1);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * h, wp, op + r * h, h, e);
  });
  return out.view(x.sizes());
}

// x, a (..., h), weight (h,) -> (s = x + a, weight * (s * rsqrt(mean(s^2) + eps))): a residual add and the
// next RMSNorm in one pass over the rows
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& weight,
                                        double eps) {
  check_float(x, "add_rms_norm");
  check_float(a, "add_rms_norm");
  check_float(weight, "add_rms_norm");
  TORCH_CHECK(x.sizes() == a.sizes(), "add_rms_norm: x and a of one shape");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.numel() == h, "add_rms_norm: weight of ", weight.numel(), " for rows of ", h);
  const auto xc = x.contiguous();
  const auto ac = a.contiguous();
  const auto wc = weight.contiguous();
  auto sum = torch::empty_like(xc);
  auto out = torch::empty_like(xc);
  const int64_t rows = xc.numel() / std::max<int64_t>(h, 1);
  const float* xp = xc.data_ptr<float>();
  const float* ap = ac.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* srow = sp + r * h;
      for (int64_t k = 0; k < h; ++k) srow[k] = xp[r * h + k] + ap[r * h + k];
      norm_row(srow, wp, op + r * h, h, e);
    }
  });
  return {sum.view(x.sizes()), out.view(x.sizes())};
}

namespace {

// out = x * cos + rotate_half(x) * sin, x and out (B, nh, T, d) any strides but the last (out may be x)
void rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  check_float(x, "rope");
  check_float(cos, "rope");
  check_float(sin, "rope");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes(), "rope: x (B, nh, T, d), cos/sin (B, T, d)");
  const int64_t B = x.size(0), nh = x.size(1), T = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0 && x.stride(3) == 1, "rope: an even head width, contiguous");
  TORCH_CHECK(d <= 1024, "rope: head width up to 1024");
  TORCH_CHECK((cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == T && cos.size(2) == d, "rope: cos/sin shape");
  const auto cc = cos.contiguous();
  const auto sc = sin.contiguous();
  const int64_t half = d / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const bool shared = cos.size(0) == 1 && B > 1;
  at::parallel_for(0, B * nh * T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / (nh * T), hh = (u / T) % nh, t = u % T;
      const float* xr = xp + b * xs0 + hh * xs1 + t * xs2;
      const int64_t c0 = ((shared ? 0 : b) * T + t) * d;
      const float* cr = cp + c0;
      const float* sr = sp + c0;
      float* orow = op + b * os0 + hh * os1 + t * os2;
      float row[1024];  // the result first: out may be x
      for (int64_t i = 0; i < half; ++i) {
        const float a = xr[i] * cr[i];
        const float r = -xr[i + half] * sr[i];
        row[i] = a + r;
      }
      for (int64_t i = half; i < d; ++i) {
        const float a = xr[i] * cr[i];
        const float r = xr[i - half] * sr[i];
        row[i] = a + r;
      }
      std::copy(row, row + d, orow);
    }
  });
}

}  // namespace

// x (B, nh, T, d) any strides but the last; cos, sin (B, T, d) -> x * cos + rotate_half(x) * sin
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto out = empty_in_order(x);
  rope_into(x, cos, sin, out);
  return out;
}

// rope in place: x (B, nh, T, d) any strides but the last, rotated where it lies
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) { rope_into(x, cos, sin, x); }

// pool (P, R, d), index (n,) int64, src (P, n, d), both any strides but the last: pool[:, index[i]] = src[:, i],
// as pool.index_copy_(1, index, src) (a step's new KV entries into the pools' rows), without its per-slice setup
void index_copy_rows_(torch::Tensor& pool, const torch::Tensor& index, const torch::Tensor& src) {
  check_float(pool, "index_copy_rows_");
  check_float(src, "index_copy_rows_");
  TORCH_CHECK(pool.dim() == 3 && src.dim() == 3 && index.dim() == 1, "index_copy_rows_: pool (P, R, d), index (n,), src (P, n, d)");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.device().is_cpu(), "index_copy_rows_: int64 CPU index");
  const int64_t P = pool.size(0), R = pool.size(1), d = pool.size(2), n = index.size(0);
  TORCH_CHECK(src.size(0) == P && src.size(1) == n && src.size(2) == d, "index_copy_rows_: src (P, n, d)");
  TORCH_CHECK(pool.stride(2) == 1 && src.stride(2) == 1, "index_copy_rows_: unit stride rows");
  const auto ic = index.contiguous();
  const int64_t* ix = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < R, "index_copy_rows_: index ", ix[i], " out of range for ", R, " rows");
  float* pp = pool.data_ptr<float>();
  const float* sp = src.data_ptr<float>();
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ss0 = src.stride(0), ss1 = src.stride(1);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < P; ++h) std::copy(sp + h * ss0 + i * ss1, sp + h * ss0 + i * ss1 + d, pp + h * ps0 + ix[i] * ps1);
  });
}

namespace {

// the first index of row p's largest value (the first NaN's, if any: torch's argmax counts NaN as the largest)
int64_t argmax_row(const float* p, int64_t V) {
  int64_t i = 0, best_i = 0;
  float best = p[0];
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 32) {  // 16 lanes, each keeping its largest value and the first index it was seen at
    __m512 bv = _mm512_loadu_ps(p);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = bi;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(p + i);
      idx = _mm512_add_epi32(idx, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
      bv = _mm512_mask_blend_ps(gt, bv, v);
      bi = _mm512_mask_blend_epi32(gt, bi, idx);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    nan = unordered != 0;
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, bv);
    _mm512_store_epi32(ids, bi);
    best = vals[0], best_i = ids[0];
    for (int l = 1; l < 16; ++l)  // the largest value; among equal ones, the first index
      if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) best = vals[l], best_i = ids[l];
  }
#endif
  for (; i < V; ++i) {
    if (std::isnan(p[i])) nan = true;
    if (p[i] > best) best = p[i], best_i = i;
  }
  if (nan || std::isnan(best))
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(p[j])) return j;
  return best_i;
}

}  // namespace

// x (R, V) float32, rows contiguous -> (R,) int64: x.argmax(dim=-1), the first index of each row's maximum
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_float(x, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "argmax_rows: x (R, V), V > 0, rows contiguous");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows shorter than 2^31");
  const int64_t R = x.size(0), V = x.size(1), rs = x.stride(0);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * rs, V);
  });
  return out;
}
