// The Python module of kvgraft's CPU kernels (kvgraft.model.cpu_kernels builds it from the three sources).
#include <torch/extension.h>

bool vectorized(int64_t D, int64_t Dv);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask, const torch::Tensor& index, double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether decode_attention's (D, Dv) run on the vector path");
  m.def("decode_attention", &decode_attention, "decode-step attention over paged keys/values read in place");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass");
  m.def("rope", &rope, "rotary embedding (rotate-half) in one pass, bit-identical to torch's ops");
}
