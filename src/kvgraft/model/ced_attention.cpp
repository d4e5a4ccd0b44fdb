// The causal encoder-decoder's decode attention for the CPU (float32): every decode row of a step attends its
// layer's window ring and its kv_source layer's shared latents, both read in place through the rows' tables, under
// one softmax, in the absorbed form (kvgraft.model.latent.LatentAttention: W_UK folded into the latent query
// before, W_UV applied after, by the caller). One call a layer replaces a gather of every row's ring and of its
// shared entries padded to the longest row, a mask, and a dozen small batched matmuls.
//
// ced_decode(qw, ql, bias, ring, rtab, seg, stab, counts, K, dc) -> [yw (G, H, dv), yl (G, H, dc), mass (G, H)]
//   qw     (G, H, dk)     the rows' queries for the window keys, pre-scaled, any strides but the last
//   ql     (G, H, Dl)     their queries for the shared entries (Dl = d_c + d_rope), pre-scaled; empty: none read
//   bias   (G, H)         added to each shared-entry score of a head (a key bias's q . b_k); empty: none
//   ring   (B, rb, E)     the layer's ring pool, contiguous; a token's row is its K keys (dk) then K values (dv)
//   rtab   (G, nrb)       int64 ring blocks of each row: ring slot j is row j % rb of block rtab[g, j / rb]
//   seg    (Bs, epb, Es)  the source layer's shared entries (latent d_c, RoPE key d_rope, ...), contiguous
//   stab   (G, nb)        int64 segment blocks of each row: entry n is row n % epb of block stab[g, n / epb]
//   counts (G, 2)         int64 per row: the ring slots [0, nw) and the shared entries [0, nl) its query sees
// Query head h reads key head h / (H / K). For each row and head, one softmax over the nw window scores and the
// nl shared scores: yw = the weights times the window values, yl = the weights times the entries' first d_c
// columns, mass = the weights' sum on the shared entries (what a value bias is scaled by). A task is a row (all its
// heads: the shared entries are read once for all of them); threads take rows from a shared counter, longest
// first. Written with ATen's Vectorized<float> (torch's own SIMD types, exp included), so one source runs AVX-512,
// AVX2 or plain C++, whichever the build targets; any widths (the last vector of a row partial).

#include "vec_blocks.h"  // first: it sets the vector width of ATen's headers
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using vecb::axpy;
using vecb::dot;
using vecb::softmax;

struct Args {
  int64_t G, H, K, dk, dv, Dl, dc, E, Es, rb, epb, nrb, nb;
  const float *qw, *ql, *bias, *ring, *seg;
  int64_t qws0, qws1, qls0, qls1, bs0;
  const int64_t *rtab, *stab, *counts;
  float *yw, *yl, *mass;
};

// Row g: its scores S (H, nw + nl), the softmax, the weighted sums into the outputs.
void row_task(const Args& a, int64_t g, std::vector<float>& S, std::vector<const float*>& rows) {
  const int64_t nw = a.counts[2 * g], nl = a.counts[2 * g + 1], L = nw + nl, R = a.H / a.K;
  S.resize(a.H * L);
  rows.resize(L);
  const int64_t* rt = a.rtab + g * a.nrb;
  for (int64_t j = 0; j < nw; ++j) rows[j] = a.ring + (rt[j / a.rb] * a.rb + j % a.rb) * a.E;
  const int64_t* st = a.stab + g * a.nb;
  for (int64_t n = 0; n < nl; ++n) rows[nw + n] = a.seg + (st[n / a.epb] * a.epb + n % a.epb) * a.Es;
  for (int64_t j = 0; j < nw; ++j) {  // window scores: each key head's keys against its R query heads
    const float* kr = rows[j];
    for (int64_t h = 0; h < a.H; ++h) S[h * L + j] = dot(a.qw + g * a.qws0 + h * a.qws1, kr + (h / R) * a.dk, a.dk);
  }
  for (int64_t n = 0; n < nl; ++n) {  // shared scores: one entry against every head
    const float* er = rows[nw + n];
    for (int64_t h = 0; h < a.H; ++h) {
      const float b = a.bias ? a.bias[g * a.bs0 + h] : 0.f;
      S[h * L + nw + n] = dot(a.ql + g * a.qls0 + h * a.qls1, er, a.Dl) + b;
    }
  }
  for (int64_t h = 0; h < a.H; ++h) softmax(S.data() + h * L, L);
  float* yw = a.yw + g * a.H * a.dv;
  float* yl = a.yl + g * a.H * a.dc;
  std::fill(yw, yw + a.H * a.dv, 0.f);
  std::fill(yl, yl + a.H * a.dc, 0.f);
  for (int64_t j = 0; j < nw; ++j) {
    const float* vr = rows[j] + a.K * a.dk;
    for (int64_t h = 0; h < a.H; ++h) axpy(S[h * L + j], vr + (h / R) * a.dv, yw + h * a.dv, a.dv);
  }
  for (int64_t n = 0; n < nl; ++n)
    for (int64_t h = 0; h < a.H; ++h) axpy(S[h * L + nw + n], rows[nw + n], yl + h * a.dc, a.dc);
  for (int64_t h = 0; h < a.H; ++h) {
    const float* sh = S.data() + h * L + nw;
    a.mass[g * a.H + h] = std::accumulate(sh, sh + nl, 0.f);
  }
}

void run(const Args& a) {
  std::vector<int64_t> order(a.G);  // longest rows first, each thread taking the next row as it finishes one
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return a.counts[2 * x] + a.counts[2 * x + 1] > a.counts[2 * y] + a.counts[2 * y + 1];
  });
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), a.G));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nth, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S;
    std::vector<const float*> rows;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next++; i < a.G; i = next++) row_task(a, order[i], S, rows);
  });
}

}  // namespace

// Whether ced_decode runs these widths: at least one float each, d_c within Dl (every build: the vector width is the
// build's, plain C++ without one).
bool ced_supported(int64_t dk, int64_t dv, int64_t Dl, int64_t dc) {
  return dk > 0 && dv > 0 && dc > 0 && dc <= Dl;
}

std::vector<torch::Tensor> ced_decode(const torch::Tensor& qw, const torch::Tensor& ql, const torch::Tensor& bias,
                                      const torch::Tensor& ring, const torch::Tensor& rtab, const torch::Tensor& seg,
                                      const torch::Tensor& stab, const torch::Tensor& counts, int64_t K, int64_t dc) {
  const char* fn = "ced_decode";
  TORCH_CHECK(qw.dim() == 3 && ring.dim() == 3 && rtab.dim() == 2 && counts.dim() == 2 && counts.size(1) == 2, fn,
              ": qw (G, H, dk), ring (B, rb, E), rtab (G, nrb), counts (G, 2)");
  for (const torch::Tensor* t : {&qw, &ql, &bias, &ring, &seg})
    TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == at::kFloat && t->device().is_cpu()), fn,
                ": float32 CPU tensors");
  TORCH_CHECK(rtab.scalar_type() == at::kLong && counts.scalar_type() == at::kLong &&
                  (stab.numel() == 0 || stab.scalar_type() == at::kLong),
              fn, ": int64 tables and counts");
  TORCH_CHECK(ring.is_contiguous() && (seg.numel() == 0 || seg.is_contiguous()), fn, ": contiguous pools");
  const int64_t G = qw.size(0), H = qw.size(1), dk = qw.size(2), E = ring.size(2);
  TORCH_CHECK(K > 0 && H % K == 0, fn, ": K (", K, ") must divide the query heads (", H, ")");
  TORCH_CHECK(E > K * dk && (E - K * dk) % K == 0, fn, ": ring rows of ", E, " floats do not hold ", K,
              " keys of ", dk, " and their values");
  const int64_t dv = (E - K * dk) / K;
  const bool shared = ql.numel() > 0;
  const int64_t Dl = shared ? ql.size(2) : 0;
  if (shared) {
    TORCH_CHECK(ql.dim() == 3 && ql.size(0) == G && ql.size(1) == H, fn, ": ql (G, H, Dl)");
    TORCH_CHECK(seg.dim() == 3 && seg.size(2) >= Dl && stab.dim() == 2 && stab.size(0) == G, fn,
                ": seg (Bs, epb, Es >= Dl), stab (G, nb)");
    TORCH_CHECK(dc > 0 && dc <= Dl, fn, ": d_c (", dc, ") in [1, ", Dl, "]");
  }
  TORCH_CHECK(bias.numel() == 0 || (shared && bias.dim() == 2 && bias.size(0) == G && bias.size(1) == H), fn,
              ": bias (G, H), with shared entries");
  TORCH_CHECK(ced_supported(dk, dv, shared ? Dl : 16, shared ? dc : 16), fn, ": widths dk ", dk, ", dv ", dv,
              ", Dl ", Dl, ", d_c ", dc, " are not accepted (each >= 1, d_c <= Dl)");
  TORCH_CHECK(rtab.size(0) == G && counts.size(0) == G, fn, ": one ring table and one count pair per row");
  const torch::Tensor qwc = qw.stride(2) == 1 ? qw : qw.contiguous();
  const torch::Tensor qlc = !shared || ql.stride(2) == 1 ? ql : ql.contiguous();
  const torch::Tensor bc = bias.contiguous(), rc = rtab.contiguous(), sc = stab.contiguous(), cc = counts.contiguous();
  const int64_t rb = ring.size(1), nrb = rc.size(1), B = ring.size(0);
  const int64_t epb = shared ? seg.size(1) : 1, nb = shared ? sc.size(1) : 0, Bs = shared ? seg.size(0) : 0;
  const int64_t *rp = rc.data_ptr<int64_t>(), *cp = cc.data_ptr<int64_t>();
  const int64_t* sp = shared ? sc.data_ptr<int64_t>() : nullptr;
  for (int64_t g = 0; g < G; ++g) {  // every slot and entry read lies in the row's table and the pools
    const int64_t nw = cp[2 * g], nl = cp[2 * g + 1];
    TORCH_CHECK(nw >= 0 && nw <= nrb * rb && nl >= 0 && (shared || nl == 0) && nl <= nb * epb && nw + nl > 0, fn,
                ": row ", g, " reads ", nw, " ring slots (its table holds ", nrb * rb, ") and ", nl,
                " shared entries (", nb * epb, "); at least one");
    for (int64_t b = 0; b < (nw + rb - 1) / rb; ++b)
      TORCH_CHECK(rp[g * nrb + b] >= 0 && rp[g * nrb + b] < B, fn, ": row ", g, " ring block ", rp[g * nrb + b],
                  " outside the pool's ", B);
    for (int64_t b = 0; b < (nl + epb - 1) / epb; ++b)
      TORCH_CHECK(sp[g * nb + b] >= 0 && sp[g * nb + b] < Bs, fn, ": row ", g, " segment block ", sp[g * nb + b],
                  " outside the pool's ", Bs);
  }
  const int64_t dco = shared ? dc : 0;
  torch::Tensor yw = torch::empty({G, H, dv}, qw.options());
  torch::Tensor yl = torch::empty({G, H, dco}, qw.options());
  torch::Tensor mass = torch::empty({G, H}, qw.options());
  const Args a{G,
               H,
               K,
               dk,
               dv,
               Dl,
               dco,
               E,
               shared ? seg.size(2) : 0,
               rb,
               epb,
               nrb,
               nb,
               qwc.data_ptr<float>(),
               shared ? qlc.data_ptr<float>() : nullptr,
               bc.numel() ? bc.data_ptr<float>() : nullptr,
               ring.data_ptr<float>(),
               shared ? seg.data_ptr<float>() : nullptr,
               qwc.stride(0),
               qwc.stride(1),
               shared ? qlc.stride(0) : 0,
               shared ? qlc.stride(1) : 0,
               bc.numel() ? bc.stride(0) : 0,
               rp,
               sp,
               cp,
               yw.data_ptr<float>(),
               yl.data_ptr<float>(),
               mass.data_ptr<float>()};
  run(a);
  return {yw, yl, mass};
}
