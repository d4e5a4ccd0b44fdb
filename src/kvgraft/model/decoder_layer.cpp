// One Llama-family decoder layer of an engine step in one call, for the CPU (float32 inference): the same kernels
// and oneDNN matmuls kvgraft.model.transformer.Block runs on a cached step, in the same order, without a return to
// Python between them (about a dozen tensor ops a layer, each a few microseconds of interpreter and dispatch).
//
// gqa_layer(x, weights, norms, step, window, write) -> the layer's output (1, N, h)
//   x        (1, N, h)  the residual stream entering the layer
//   weights  [qkv, qkv bias, o, o bias, gate/up, gate/up bias, down, down bias]: oneDNN-packed weights (q/k/v and
//            gate/up concatenated, as kvgraft.model.packed packs them) and their biases (empty tensors: none)
//   norms    [input norm weight, post-attention norm weight] and eps (both norms')
//   step     [cos (1, N, d), sin (1, N, d), pool (2K, B, bs, d), slots (N,), tables (rows, nb), rows (rows, 3)]:
//            the step's rotary tables and the layer's pool with where each new token goes and each row reads
//   heads    (H, K): query and key heads; window: 0 or the layer's window; write: store the new entries
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <optional>
#include <vector>

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& weight,
                                        double eps);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gu);
void index_copy_rows_(torch::Tensor& pool, const torch::Tensor& index, const torch::Tensor& src);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                              const torch::Tensor& rows, int64_t window, double scale);

namespace {

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None): the matmul kvgraft.model.packed runs
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  const std::optional<at::Tensor> bias = b.numel() ? std::optional<at::Tensor>(b) : std::nullopt;
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

torch::Tensor gqa_layer(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                        const std::vector<torch::Tensor>& norms, double eps, const std::vector<torch::Tensor>& step,
                        int64_t H, int64_t K, int64_t window, bool write) {
  TORCH_CHECK(weights.size() == 8 && norms.size() == 2 && step.size() == 6, "gqa_layer: 8 weights, 2 norms, 6 step tensors");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "gqa_layer: x (1, N, h)");
  const torch::Tensor &cos = step[0], &sin = step[1], &pool = step[2], &slots = step[3], &tables = step[4], &rows = step[5];
  const int64_t N = x.size(1), d = pool.size(3);
  TORCH_CHECK(pool.dim() == 4 && pool.size(0) == 2 * K && H % K == 0, "gqa_layer: pool (2K, B, bs, d)");
  const torch::Tensor h = rms_norm(x, norms[0], eps);
  const torch::Tensor qkv = linear(h, weights[0], weights[1]);  // (1, N, (H + 2K) d): q, k, v of each token
  TORCH_CHECK(qkv.size(2) == (H + 2 * K) * d && qkv.stride(2) == 1, "gqa_layer: the q/k/v matmul's width");
  const torch::Tensor heads = qkv.view({N, H + 2 * K, d});
  torch::Tensor qk = qkv.view({1, N, H + 2 * K, d}).narrow(2, 0, H + K).transpose(1, 2);  // (1, H + K, N, d)
  rope_(qk, cos, sin);  // q and k rotated where the matmul wrote them
  if (write) {
    torch::Tensor rows_of_pool = pool.view({2 * K, -1, d});
    index_copy_rows_(rows_of_pool, slots, heads.narrow(1, H, 2 * K).transpose(0, 1));  // (2K, N, d)
  }
  const double scale = std::pow(static_cast<double>(d), -0.5);  // as Python's d**-0.5
  const torch::Tensor att = paged_attention(heads.narrow(1, 0, H), pool, tables, rows, window, scale).view({1, N, H * d});
  const torch::Tensor a = linear(att, weights[2], weights[3]);
  const std::vector<torch::Tensor> xh = add_rms_norm(x, a, norms[1], eps);  // (x + a, norm(x + a))
  const torch::Tensor gu = linear(xh[1], weights[4], weights[5]);
  const torch::Tensor y = linear(silu_mul(gu), weights[6], weights[7]);
  return xh[0] + y;
}
