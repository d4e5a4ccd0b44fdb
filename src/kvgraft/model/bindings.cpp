// The Python module of kvgraft's CPU kernels (kvgraft.model.cpu_kernels builds it from the seven sources).
#include <torch/extension.h>

bool vectorized(int64_t D, int64_t Dv);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask, const torch::Tensor& index, double scale);
bool prefill_vectorized(int64_t D, int64_t Dv);
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& mask, const torch::Tensor& index, double scale);
bool paged_vectorized(int64_t D);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                              const torch::Tensor& rows, int64_t window, double scale);
bool ced_supported(int64_t dk, int64_t dv, int64_t Dl, int64_t dc);
std::vector<torch::Tensor> ced_decode(const torch::Tensor& qw, const torch::Tensor& ql, const torch::Tensor& bias,
                                      const torch::Tensor& ring, const torch::Tensor& rtab, const torch::Tensor& seg,
                                      const torch::Tensor& stab, const torch::Tensor& counts, int64_t K, int64_t dc);
torch::Tensor gqa_layer(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                        const std::vector<torch::Tensor>& norms, double eps, const std::vector<torch::Tensor>& step,
                        int64_t H, int64_t K, int64_t window, bool write);
torch::Tensor argmax_rows(const torch::Tensor& x);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gu);
void index_copy_rows_(torch::Tensor& pool, const torch::Tensor& index, const torch::Tensor& src);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& weight,
                                        double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether decode_attention's (D, Dv) run on the vector path");
  m.def("decode_attention", &decode_attention, "decode-step attention over paged keys/values read in place");
  m.def("prefill_vectorized", &prefill_vectorized, "whether prefill_attention runs (D, Dv)");
  m.def("prefill_attention", &prefill_attention, "prefill attention over paged keys/values read in place, flash-style");
  m.def("paged_vectorized", &paged_vectorized, "whether paged_attention runs head width D");
  m.def("paged_attention", &paged_attention, "a whole step's attention over a paged GQA pool, rows of any length");
  m.def("ced_supported", &ced_supported, "whether ced_decode runs widths (dk, dv, Dl, dc)");
  m.def("ced_decode", &ced_decode, "a causal encoder-decoder layer's decode rows over their ring and shared latents");
  m.def("gqa_layer", &gqa_layer, "one Llama-family decoder layer of an engine step in one call");
  m.def("argmax_rows", &argmax_rows, "x.argmax(dim=-1) over a (rows, vocab) float32 matrix");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass");
  m.def("add_rms_norm", &add_rms_norm, "a residual add and RMSNorm in one pass: (x + a, norm(x + a))");
  m.def("rope", &rope, "rotary embedding (rotate-half) in one pass, bit-identical to torch's ops");
  m.def("rope_", &rope_, "rope in place");
  m.def("index_copy_rows_", &index_copy_rows_, "pool.index_copy_(1, index, src) for (P, R, d) pools");
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up over one matmul's [gate | up] rows, in one pass");
}
