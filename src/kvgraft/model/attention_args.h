// What decode_attention and prefill_attention share: their arguments, checked once, with the pointers and
// strides a task reads, and the range of keys a run of queries may see.
//   q (G, H, T, D) any strides but the last; k (K, n, S, D), v (K, n, S, Dv) any strides but the last;
//   mask (G, T, S) bool; index (G,) int64 slots among the n (empty: row g is slot g).
// The output is stored token-major, (G, T, H, Dv), and returned as its (G, H, T, Dv) view: a token's heads
// side by side, as the output projection reads them.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <string>

struct AttentionArgs {
  int64_t G, H, T, D, K, n, S, Dv, R;
  torch::Tensor qc, mc, ic, out;
  const float *qp, *kp, *vp;
  const bool* mp;
  const int64_t* ip;
  float* op;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;
  const char* name;

  AttentionArgs(const char* fn, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const torch::Tensor& mask, const torch::Tensor& index, double sc)
      : name(fn) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3, fn, ": q/k/v 4-d, mask 3-d");
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, fn,
                ": float32 only");
    TORCH_CHECK(mask.scalar_type() == at::kBool, fn, ": bool mask");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, fn, ": keys/values contiguous in their last axis");
    G = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
    K = k.size(0), n = k.size(1), S = k.size(2), Dv = v.size(3);
    TORCH_CHECK(K > 0 && H % K == 0, fn, ": key heads must divide query heads");
    TORCH_CHECK(k.size(3) == D && v.size(0) == K && v.size(1) == n && v.size(2) == S, fn, ": k/v shapes");
    TORCH_CHECK(mask.size(0) == G && mask.size(1) == T && mask.size(2) == S, fn, ": mask shape");
    const bool indexed = index.numel() > 0;
    TORCH_CHECK(indexed ? (index.scalar_type() == at::kLong && index.numel() == G) : G <= n, fn,
                ": index (G,) int64 into the slots");
    R = H / K;
    qc = q.stride(3) == 1 ? q : q.contiguous();  // read in place: any strides but the last
    mc = mask.contiguous();
    ic = indexed ? index.contiguous() : index;
    out = torch::empty({G, T, H, Dv}, q.options());
    qp = qc.data_ptr<float>(), kp = k.data_ptr<float>(), vp = v.data_ptr<float>();
    mp = mc.data_ptr<bool>();
    ip = indexed ? ic.data_ptr<int64_t>() : nullptr;
    op = out.data_ptr<float>();
    qs0 = qc.stride(0), qs1 = qc.stride(1), qs2 = qc.stride(2);
    ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
    vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
    scale = static_cast<float>(sc);
  }

  // row g's slot among the n
  int64_t slot(int64_t g) const {
    const int64_t s = ip ? ip[g] : g;
    TORCH_CHECK(s >= 0 && s < n, name, ": index out of range");
    return s;
  }
  const bool* mask_row(int64_t g, int64_t t) const { return mp + (g * T + t) * S; }
  // query of row g, query head hq, token t
  const float* query(int64_t g, int64_t hq, int64_t t) const { return qp + g * qs0 + hq * qs1 + t * qs2; }
  const float* keys(int64_t h, int64_t slot) const { return kp + h * ks0 + slot * ks1; }
  const float* values(int64_t h, int64_t slot) const { return vp + h * vs0 + slot * vs1; }
  float* output(int64_t g, int64_t t, int64_t hq) const { return op + ((g * T + t) * H + hq) * Dv; }
  torch::Tensor result() const { return out.permute({0, 2, 1, 3}); }

  // [lo, hi): the keys any of tokens [t0, t1) of row g may see (lo >= hi: none)
  void visible_range(int64_t g, int64_t t0, int64_t t1, int64_t& lo, int64_t& hi) const {
    lo = S, hi = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const bool* mt = mask_row(g, t);
      int64_t a = 0, b = S;
      while (a < S && !mt[a]) ++a;
      while (b > a && !mt[b - 1]) --b;
      if (a < b) lo = std::min(lo, a), hi = std::max(hi, b);
    }
  }
};
