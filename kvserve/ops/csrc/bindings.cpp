// Tensor-level entry points: check every precondition the raw kernels rely on, allocate the
// outputs, pass torch's thread count. kvserve/ops/cpu.py decides *whether* to call these
// (dtype, size crossovers); a failed TORCH_CHECK here is a bug in that routing.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"
#include "llama_stack.h"
#include "tensor_args.h"

namespace {

using namespace kvs_args;  // NOLINT: the checks shared with llama_stack.cpp

// x [M, K] (rows may be strided), weight [N, K] float32 (wtype 0) or [N, row bytes] uint8
// GGUF blocks of the named format (3 Q4_1, 8 Q8_0), contiguous -> [M, N]. avx512: use the
// AVX-512 kernel; refused (not silently ignored) on a CPU without it.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t wtype,
                     const c10::optional<torch::Tensor>& bias, bool avx512) {
  check_f32(x, "x");
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear expects x [M, K] and a 2-D weight, got ",
              x.sizes(), " and ", weight.sizes());
  check_inner(x, "x");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  const kvs::WType wt = checked_weight_type(weight, wtype, K);
  const float* b = bias_ptr(bias, N);
  auto out = torch::empty({M, N}, x.options());
  TORCH_CHECK(!avx512 || kvs::cpu_has_avx512(), "linear(avx512=True) on a CPU without AVX-512F");
  if (M > 0 && N > 0) {
    auto kernel = avx512 ? kvs::linear_small_m_avx512 : kvs::linear_small_m;
    kernel(x.data_ptr<float>(), x.stride(0), weight.data_ptr(), wt, b, out.data_ptr<float>(), M,
           N, K, at::get_num_threads());
  }
  return out;
}

// x [M, K] float32 -> (q int8 [M, K], d, s float32 [M, K / 32], sum int32 [M, K / 32]).
std::vector<torch::Tensor> quantize_acts(const torch::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [M, K] with K % 32 == 0, got ",
              x.sizes());
  check_inner(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, K / 32}, x.options());
  auto s = torch::empty({M, K / 32}, x.options());
  auto sum = torch::empty({M, K / 32}, x.options().dtype(torch::kInt32));
  kvs::quantize_acts(x.data_ptr<float>(), x.stride(0), M, K, q.data_ptr<int8_t>(),
                     d.data_ptr<float>(), s.data_ptr<float>(), sum.data_ptr<int32_t>(),
                     at::get_num_threads());
  return {q, d, s, sum};
}

// x [M, K] float32 against a packed GGUF weight [ceil(N / 16), K / 32, record bytes: 288
// (Q4_0, IQ4_NL), 320 (Q4_1), 352 (Q5_0), 384 (Q5_1) or 544 (Q8_0)] (kvserve/quant/block_pack.py
// pack) -> [M, N]: x quantized to int8 per 32 values, then the exact int dot products scaled
// per block (kernels.h qlinear). avx512: the VNNI kernel.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& weight, int64_t wtype,
                      int64_t N, const c10::optional<torch::Tensor>& bias, bool avx512) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  check_inner(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  const kvs::WType wt = checked_packed_type(weight, wtype, K, N);
  const float* b = bias_ptr(bias, N);
  auto out = torch::empty({M, N}, x.options());
  quantized_linear(x.data_ptr<float>(), x.stride(0), M, K, weight.data_ptr<uint8_t>(), wt, b,
                   out.data_ptr<float>(), N, avx512, at::get_num_threads());
  return out;
}

// uint8 GGUF rows of K weights in the named format -> float32 [N, K], the kernels' values.
torch::Tensor dequantize(const torch::Tensor& weight, int64_t wtype, int64_t K) {
  return dequantize_weight(weight, wtype, K);
}

// kv_scales: a quantized (int8 / uint8 fp8) cache layer's [2, num_blocks, block_size, Hkv].
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale,
                              const c10::optional<torch::Tensor>& kv_scales) {
  check_f32(q, "q");
  const kvs::KVType kv_type = check_kv_cache(kv_cache, kv_scales);
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D], got ", q.sizes());
  check_inner(q, "q");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "kv_cache head_dim ", kv_cache.size(4), " != q's ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num heads ", H, " must be a multiple of kv heads ", Hkv);
  const auto meta = checked_attention_meta(block_tables, seq_lens, query_start_loc, q.size(0),
                                           kv_cache.size(2));
  auto out = torch::empty({q.size(0), H, D}, q.options());
  const auto a = attention_args(q.data_ptr<float>(), q.stride(0), q.stride(1),
                                kv_cache.data_ptr(), v_cache_ptr(kv_cache), kv_type, meta,
                                out.data_ptr<float>(), H, Hkv, D, kv_cache.size(2), scale,
                                kv_scale_ptrs(kv_scales));
  kvs::paged_attention(a, at::get_num_threads());
  return out;
}

// kv_scales: as paged_attention's, written beside a quantized cache.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
              const torch::Tensor& slot_mapping, const c10::optional<torch::Tensor>& kv_scales) {
  check_f32(key, "key");
  check_f32(value, "value");
  const kvs::KVType kv_type = check_kv_cache(kv_cache, kv_scales);
  const int64_t Hkv = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == Hkv &&
                  key.size(2) == D,
              "key/value must be [T, ", Hkv, ", ", D, "], got ", key.sizes(), " and ",
              value.sizes());
  check_inner(key, "key");
  check_inner(value, "value");
  const int64_t T = key.size(0);
  const auto slots = checked_slots(slot_mapping, T, kv_cache.size(1) * kv_cache.size(2));
  const int64_t* sp = slots.data_ptr<int64_t>();
  const auto [k_sc, v_sc] = kv_scale_ptrs(kv_scales);
  kvs::write_kv(key.data_ptr<float>(), key.stride(0), key.stride(1), value.data_ptr<float>(),
                value.stride(0), value.stride(1), kv_cache.data_ptr(), v_cache_ptr(kv_cache),
                kv_type, k_sc, v_sc, sp, T, Hkv, D);
}

// x as [rows, n] with a row stride (cpu.py reshapes to 2-D, which stays a view when it can).
int64_t row_stride(const torch::Tensor& x, const char* name) {
  check_f32(x, name);
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D [rows, n], got ", x.sizes());
  check_inner(x, name);
  return x.stride(0);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t ldx = row_stride(x, "x");
  check_f32(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must be [", n, "]");
  auto out = torch::empty(x.sizes(), x.options());
  kvs::rms_norm(x.data_ptr<float>(), ldx, weight.data_ptr<float>(), out.data_ptr<float>(),
                x.size(0), n, static_cast<float>(eps), at::get_num_threads());
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  const int64_t ldx = row_stride(x, "x");
  const int64_t ldr = row_stride(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x ", x.sizes(), " and residual ",
              residual.sizes(), " differ");
  check_f32(weight, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must be [", n, "]");
  auto out = torch::empty(x.sizes(), x.options());
  auto res = torch::empty(x.sizes(), x.options());
  kvs::add_rms_norm(x.data_ptr<float>(), ldx, residual.data_ptr<float>(), ldr,
                    weight.data_ptr<float>(), out.data_ptr<float>(), res.data_ptr<float>(),
                    x.size(0), n, static_cast<float>(eps), at::get_num_threads());
  return {out, res};
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  const int64_t ldx = row_stride(x, "x");
  const int64_t n2 = x.size(-1);
  TORCH_CHECK(n2 % 2 == 0, "silu_and_mul needs an even last dimension, got ", n2);
  auto out = torch::empty({x.size(0), n2 / 2}, x.options());
  kvs::silu_and_mul(x.data_ptr<float>(), ldx, out.data_ptr<float>(), x.size(0), n2 / 2,
                    at::get_num_threads());
  return out;
}

torch::Tensor rotary_one(const torch::Tensor& x, const torch::Tensor& pos,
                         const torch::Tensor& cos_sin) {
  check_f32(x, "q/k");
  TORCH_CHECK(x.dim() == 3, "q/k must be [T, heads, D], got ", x.sizes());
  check_inner(x, "q/k");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  TORCH_CHECK(cos_sin.size(1) == D, "cos_sin width ", cos_sin.size(1), " != head_dim ", D);
  auto out = torch::empty({T, heads, D}, x.options());
  kvs::rotary(x.data_ptr<float>(), x.stride(0), x.stride(1), out.data_ptr<float>(), T, heads, D,
              pos.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), cos_sin.size(0),
              at::get_num_threads());
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& positions,
                                                const torch::Tensor& cos_sin) {
  TORCH_CHECK(q.size(0) == k.size(0), "q has ", q.size(0), " tokens, k ", k.size(0));
  const auto pos = checked_positions(positions, q.size(0), cos_sin);
  return {rotary_one(q, pos, cos_sin), rotary_one(k, pos, cos_sin)};
}

// x [M, K] float32 (K % 256 == 0) -> Q8_K (q int8 [M, K], d float32 [M, K / 256], bsums int16
// [M, K / 16]), llama.cpp's quantize_row_q8_K_ref (kernels.h quantize_acts_q8k).
std::vector<torch::Tensor> quantize_acts_q8k(const torch::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 256 == 0, "x must be [M, K] with K % 256 == 0, got ",
              x.sizes());
  check_inner(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, K / 256}, x.options());
  auto bsums = torch::empty({M, K / 16}, x.options().dtype(torch::kInt16));
  kvs::quantize_acts_q8k(x.data_ptr<float>(), x.stride(0), M, K, q.data_ptr<int8_t>(),
                         d.data_ptr<float>(), bsums.data_ptr<int16_t>(), at::get_num_threads());
  return {q, d, bsums};
}

// x [M, K] float32 against a packed K-quant weight [ceil(N / 16), K / 256, record bytes
// (kernels.h kquant_record_bytes)] (kvserve/quant/kquant_pack.py) -> [M, N]: x quantized to
// Q8_K, then the exact integer dot products in ggml_kquants.dot_kquant's float order
// (kernels.h qlinear_kquant).
// avx512: the VNNI kernel; amx: with AMX tiles for 4+ rows (avx512 too).
torch::Tensor qlinear_kquant(const torch::Tensor& x, const torch::Tensor& weight, int64_t wtype,
                             int64_t N, const c10::optional<torch::Tensor>& bias, bool avx512,
                             bool amx) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  check_inner(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  const kvs::KType kt = checked_kquant_type(weight, wtype, K, N);
  const float* b = bias_ptr(bias, N);
  auto out = torch::empty({M, N}, x.options());
  kquant_linear(x.data_ptr<float>(), x.stride(0), M, K, weight.data_ptr<uint8_t>(), kt, b,
                out.data_ptr<float>(), N, avx512, amx, at::get_num_threads());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve AVX2/FMA CPU kernels; see kvserve/ops/cpu.py";
  // Kernels run without the GIL: the server's event loop thread keeps answering HTTP while
  // the engine thread is inside a forward pass (torch's own ops release it the same way).
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &linear, "small-M linear", py::arg("x"), py::arg("weight"), py::arg("wtype"),
        py::arg("bias"), py::arg("avx512") = false, nogil());
  m.def("qlinear", &qlinear, "packed GGUF weight x int8-quantized activations",
        py::arg("x"), py::arg("weight"), py::arg("wtype"), py::arg("N"), py::arg("bias"),
        py::arg("avx512") = false, nogil());
  m.def("quantize_acts", &quantize_acts, "activations -> int8 per 32 (q, d, s, sum)", nogil());
  m.def("cpu_has_avx512_vnni", &kvs::cpu_has_avx512_vnni, "AVX-512 VNNI + BW usable");
  m.def("dequantize", &dequantize, "GGUF Q4_1 / Q8_0 rows -> float32", py::arg("weight"),
        py::arg("wtype"), py::arg("K"), nogil());
  m.def("cpu_has_avx512", &kvs::cpu_has_avx512, "AVX-512F usable (CPU and OS)");
  m.def("paged_attention", &paged_attention, "varlen paged attention", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("kv_scales") = py::none(),
        nogil());
  m.def("write_kv", &write_kv, "scatter K/V into the paged cache (quantized: with scales)",
        py::arg("key"), py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"),
        py::arg("kv_scales") = py::none(), nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm", nogil());
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm", nogil());
  m.def("silu_and_mul", &silu_and_mul, "fused SiLU(gate) * up", nogil());
  m.def("rotary", &rotary, "rotate-half RoPE", nogil());
  m.def("quantize_acts_q8k", &quantize_acts_q8k, "activations -> Q8_K (q, d, bsums)",
        py::arg("x"), nogil());
  m.def("qlinear_kquant", &qlinear_kquant, "packed GGUF K-quant weight x Q8_K activations",
        py::arg("x"), py::arg("weight"), py::arg("wtype"), py::arg("N"), py::arg("bias"),
        py::arg("avx512") = false, py::arg("amx") = false, nogil());
  m.def("cpu_has_amx_int8", &kvs::cpu_has_amx_int8,
        "AMX-TILE + AMX-INT8 usable (asks Linux for the tile state once)");
  // module_local: two builds of the extension (another source hash) may share a process.
  using LinW = LlamaStack::LinearWeights;
  py::class_<LinW>(m, "LinearWeights", py::module_local(),
                   "one linear's weight for LlamaStack: runs of output rows, a format each")
      .def(py::init([](std::vector<torch::Tensor> parts, std::vector<int64_t> wtypes,
                       std::vector<int64_t> rows, c10::optional<torch::Tensor> perm) {
             return LinW{std::move(parts), std::move(wtypes), std::move(rows), std::move(perm)};
           }),
           py::arg("parts"), py::arg("wtypes"), py::arg("rows"), py::arg("perm") = py::none());
  using LW = LlamaStack::LayerWeights;
  py::class_<LW>(m, "LayerWeights", py::module_local(),
                 "one decoder layer's weights and shape for LlamaStack (fields by name)")
      .def(py::init<>())
      .def_readwrite("in_norm", &LW::in_norm)
      .def_readwrite("post_norm", &LW::post_norm)
      .def_readwrite("eps", &LW::eps)
      .def_readwrite("qkv", &LW::qkv)
      .def_readwrite("qkv_bias", &LW::qkv_bias)
      .def_readwrite("o", &LW::o)
      .def_readwrite("gate_up", &LW::gate_up)
      .def_readwrite("down", &LW::down)
      .def_readwrite("heads", &LW::heads)
      .def_readwrite("kv_heads", &LW::kv_heads)
      .def_readwrite("head_dim", &LW::head_dim)
      .def_readwrite("scale", &LW::scale);
  py::class_<LlamaStack>(m, "LlamaStack", py::module_local(),
                         "a run of a Llama model's decoder layers per call")
      .def(py::init<const std::vector<LW>&, bool, int64_t, py::object, bool>(),
           py::arg("layers"), py::arg("avx512"), py::arg("small_m"),
           py::arg("all_reduce") = py::none(), py::arg("amx") = false)
      .def("forward", &LlamaStack::forward, "x through every layer -> (out, residual)",
           py::arg("x"), py::arg("residual"), py::arg("positions"), py::arg("cos_sin"),
           py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("kv_scales") = py::none(),
           nogil());
}
