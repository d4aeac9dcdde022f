// Tensor-level entry points: check every precondition the raw kernels rely on, allocate the
// outputs, pass torch's thread count. kvserve/ops/cpu.py decides *whether* to call these
// (dtype, size crossovers); a failed TORCH_CHECK here is a bug in that routing.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_inner(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// One layer of the paged cache, [2, num_blocks, block_size, Hkv, D], float32 or float16
// (kernels.h AttentionArgs); returns whether it is float16.
bool check_kv_cache(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu() && (kv_cache.scalar_type() == torch::kFloat32 ||
                                             kv_cache.scalar_type() == torch::kFloat16),
              "kv_cache must be a float32 or float16 CPU tensor, got ", kv_cache.scalar_type(),
              " on ", kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be one contiguous layer [2, num_blocks, block_size, Hkv, D], got ",
              kv_cache.sizes());
  return kv_cache.scalar_type() == torch::kFloat16;
}

// The V half of a checked kv_cache layer: K's data pointer plus stride(0) elements.
void* v_cache_ptr(const torch::Tensor& kv_cache) {
  return static_cast<char*>(kv_cache.data_ptr()) + kv_cache.stride(0) * kv_cache.element_size();
}

torch::Tensor as_int32(const torch::Tensor& t) {
  return t.scalar_type() == torch::kInt32 ? t.contiguous() : t.to(torch::kInt32).contiguous();
}

torch::Tensor as_int64(const torch::Tensor& t) {
  return t.scalar_type() == torch::kInt64 ? t.contiguous() : t.to(torch::kInt64).contiguous();
}

// A uint8 weight [N, row bytes] holds GGUF Q4_1 or Q8_0 rows; which one is read off the row
// length (20 or 34 bytes per 32 weights), the only two quantized formats the kernels take.
kvs::WType weight_type(const torch::Tensor& weight, int64_t K) {
  if (weight.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(weight.size(1) == K, "weight [N, K] has K=", weight.size(1), ", x has ", K);
    return kvs::WType::F32;
  }
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8,
              "weight must be float32 or uint8 (GGUF blocks), got ", weight.scalar_type());
  TORCH_CHECK(K % 32 == 0, "a quantized weight needs K % 32 == 0, got K=", K);
  for (auto wt : {kvs::WType::Q4_1, kvs::WType::Q8_0})
    if (weight.size(1) == kvs::row_bytes(wt, K)) return wt;
  TORCH_CHECK(false, "uint8 weight rows of ", weight.size(1), " bytes are neither Q4_1 nor Q8_0 "
              "blocks for K=", K);
}

// x [M, K] (rows may be strided), weight [N, K] float32 or [N, row bytes] uint8 (GGUF Q4_1 /
// Q8_0), contiguous -> [M, N]. avx512: use the AVX-512 kernel; refused (not silently
// ignored) on a CPU without it.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& bias, bool avx512) {
  check_f32(x, "x");
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear expects x [M, K] and a 2-D weight, got ",
              x.sizes(), " and ", weight.sizes());
  check_inner(x, "x");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  const kvs::WType wt = weight_type(weight, K);
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "bias must be [N]");
    b = bias->data_ptr<float>();
  }
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

// x [M, K] float32 against a packed GGUF weight [ceil(N / 16), K / 32, 320 (Q4_1) or 544
// (Q8_0)] (kvserve/quant/gguf.py pack) -> [M, N]: x quantized to int8 per 32 values, then
// the exact int dot products scaled per block (kernels.h qlinear). avx512: the VNNI kernel.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& weight, int64_t N,
                      const c10::optional<torch::Tensor>& bias, bool avx512) {
  check_f32(x, "x");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kUInt8 &&
                  weight.dim() == 3 && weight.is_contiguous(),
              "a packed weight is a contiguous uint8 [groups, K / 32, record bytes] tensor, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t rb = weight.size(2);
  TORCH_CHECK(rb == 16 * kvs::row_bytes(kvs::WType::Q4_1, 32) ||
                  rb == 16 * kvs::row_bytes(kvs::WType::Q8_0, 32),
              "packed records of ", rb, " bytes are neither Q4_1 (320) nor Q8_0 (544)");
  const kvs::WType wt = rb == 320 ? kvs::WType::Q4_1 : kvs::WType::Q8_0;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) * 32, "x [M, K] must have K = ",
              weight.size(1) * 32, " for this packed weight, got ", x.sizes());
  check_inner(x, "x");
  TORCH_CHECK(N > 16 * (weight.size(0) - 1) && N <= 16 * weight.size(0), "N=", N,
              " does not fit ", weight.size(0), " groups of 16 rows");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "bias must be [N]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(!avx512 || kvs::cpu_has_avx512_vnni(),
              "qlinear(avx512=True) on a CPU without AVX-512 VNNI");
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  // The quantized activations live in per-thread buffers that only grow: a decode step makes
  // ~120 of these calls, and four tensor allocations each cost more than quantizing a row.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> sum;
  if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
  if (static_cast<int64_t>(d.size()) < M * K / 32) {
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    sum.resize(M * K / 32);
  }
  kvs::quantize_acts(x.data_ptr<float>(), x.stride(0), M, K, q.data(), d.data(), s.data(),
                     sum.data(), at::get_num_threads());
  const kvs::QActs a{q.data(), d.data(), s.data(), sum.data(), M, K};
  auto kernel = avx512 ? kvs::qlinear_avx512 : kvs::qlinear;
  kernel(a, weight.data_ptr<uint8_t>(), wt, b, out.data_ptr<float>(), N, at::get_num_threads());
  return out;
}

// uint8 GGUF rows (Q4_1 / Q8_0) of K weights -> float32 [N, K], the kernels' values.
torch::Tensor dequantize(const torch::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D CPU tensor");
  const kvs::WType wt = weight_type(weight, K);
  if (wt == kvs::WType::F32) return weight;
  auto out = torch::empty({weight.size(0), K}, weight.options().dtype(torch::kFloat32));
  kvs::dequantize_rows(weight.data_ptr(), wt, out.data_ptr<float>(), weight.size(0), K,
                       at::get_num_threads());
  return out;
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale) {
  check_f32(q, "q");
  const bool kv_f16 = check_kv_cache(kv_cache);
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D], got ", q.sizes());
  check_inner(q, "q");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "kv_cache head_dim ", kv_cache.size(4), " != q's ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num heads ", H, " must be a multiple of kv heads ", Hkv);
  auto bt = as_int32(block_tables);
  auto sl = as_int32(seq_lens);
  auto qsl = as_int32(query_start_loc);
  const int64_t B = sl.numel();
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) >= B && qsl.numel() == B + 1,
              "block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1] disagree: ",
              bt.sizes(), ", ", sl.sizes(), ", ", qsl.sizes());
  // The kernel trusts these bounds; checking them costs O(B) and saves a segfault.
  const int32_t* s = sl.data_ptr<int32_t>();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == q.size(0), "query_start_loc must run from 0 to T=",
              q.size(0));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = qs[b + 1] - qs[b];
    TORCH_CHECK(ql >= 0 && ql <= s[b], "request ", b, " has ", ql, " queries but seq_len ",
                s[b]);
    TORCH_CHECK((s[b] + kv_cache.size(2) - 1) / kv_cache.size(2) <= bt.size(1), "request ", b,
                " seq_len ", s[b], " needs more blocks than block_tables has columns");
  }
  auto out = torch::empty({q.size(0), H, D}, q.options());
  kvs::AttentionArgs a;
  a.q = q.data_ptr<float>();
  a.q_st = q.stride(0);
  a.q_sh = q.stride(1);
  a.k_cache = kv_cache.data_ptr();
  a.v_cache = v_cache_ptr(kv_cache);
  a.kv_f16 = kv_f16;
  a.block_tables = bt.data_ptr<int32_t>();
  a.bt_stride = bt.stride(0);
  a.seq_lens = s;
  a.query_start_loc = qs;
  a.out = out.data_ptr<float>();
  a.B = B;
  a.H = H;
  a.Hkv = Hkv;
  a.D = D;
  a.block_size = kv_cache.size(2);
  a.scale = static_cast<float>(scale);
  kvs::paged_attention(a, at::get_num_threads());
  return out;
}

void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
              const torch::Tensor& slot_mapping) {
  check_f32(key, "key");
  check_f32(value, "value");
  const bool kv_f16 = check_kv_cache(kv_cache);
  const int64_t Hkv = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == Hkv &&
                  key.size(2) == D,
              "key/value must be [T, ", Hkv, ", ", D, "], got ", key.sizes(), " and ",
              value.sizes());
  check_inner(key, "key");
  check_inner(value, "value");
  auto slots = as_int64(slot_mapping);
  const int64_t T = key.size(0);
  TORCH_CHECK(slots.numel() == T, "slot_mapping has ", slots.numel(), " slots for ", T,
              " tokens");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is past the cache's ", num_slots, " slots");
  kvs::write_kv(key.data_ptr<float>(), key.stride(0), key.stride(1), value.data_ptr<float>(),
                value.stride(0), value.stride(1), kv_cache.data_ptr(), v_cache_ptr(kv_cache),
                kv_f16, sp, T, Hkv, D);
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
  check_f32(cos_sin, "cos_sin");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(1) % 2 == 0,
              "cos_sin must be contiguous [max_pos, D] with D even");
  auto pos = as_int64(positions);
  TORCH_CHECK(pos.numel() == q.size(0) && pos.numel() == k.size(0), "positions has ",
              pos.numel(), " entries for ", q.size(0), " tokens");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos_sin.size(0), "position ", p[t], " outside [0, ",
                cos_sin.size(0), ")");
  return {rotary_one(q, pos, cos_sin), rotary_one(k, pos, cos_sin)};
}

}  // namespace

// One Llama decoder layer in a single call: pre-norm attention then SwiGLU MLP, exactly the
// sequence of kvserve/models/llama.py (LlamaDecoderLayer.forward is the specification and the
// fallback). It saves the ~12 Python->C++ round trips of a layer, about 2 ms of a 12 ms decode
// step on the 30-layer default model. Same kernels in the same order, so the result equals
// the unfused path bit for bit. Linears with more than small_m rows go to at::linear (MKL),
// as CpuOps.linear does (a quantized weight dequantized first). Linear weights may be float32
// or GGUF Q4_1 / Q8_0 blocks (see linear()); the kv_cache layer float32 or float16 (write_kv
// and paged_attention check it).
std::tuple<torch::Tensor, torch::Tensor> llama_layer(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& input_norm, const torch::Tensor& post_norm, double eps,
    const torch::Tensor& qkv_w, const c10::optional<torch::Tensor>& qkv_b,
    const torch::Tensor& o_w, const torch::Tensor& gate_up_w, const torch::Tensor& down_w,
    int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, const torch::Tensor& positions,
    const torch::Tensor& cos_sin, torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
    const torch::Tensor& query_start_loc, double scale, bool avx512, int64_t small_m) {
  // A packed weight (3-D) goes to qlinear at every M; its output count N is not in its shape
  // (the last group may be padded), so each call names it.
  auto lin = [&](const torch::Tensor& a, const torch::Tensor& w,
                 const c10::optional<torch::Tensor>& b, int64_t n) {
    if (w.dim() == 3) return qlinear(a, w, n, b, avx512 && kvs::cpu_has_avx512_vnni());
    if (a.size(0) <= small_m) return linear(a, w, b, avx512);
    return at::linear(a, w.scalar_type() == torch::kUInt8 ? dequantize(w, a.size(1)) : w, b);
  };
  torch::Tensor h, res;
  if (residual.has_value()) {
    std::tie(h, res) = add_rms_norm(x, *residual, input_norm, eps);
  } else {
    h = rms_norm(x, input_norm, eps);
    res = x;
  }
  const int64_t T = x.size(0), q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim;
  const int64_t hidden = x.size(1);
  const int64_t inter = down_w.dim() == 3 ? down_w.size(1) * 32 : down_w.size(1);
  auto qkv = lin(h, qkv_w, qkv_b, q_size + 2 * kv_size);
  auto q = qkv.narrow(1, 0, q_size).view({T, n_heads, head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({T, n_kv_heads, head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, n_kv_heads, head_dim});
  torch::Tensor qr, kr;
  std::tie(qr, kr) = rotary(q, k, positions, cos_sin);
  write_kv(kr, v, kv_cache, slot_mapping);
  auto o = paged_attention(qr, kv_cache, block_tables, seq_lens, query_start_loc, scale);
  auto attn = lin(o.reshape({T, q_size}), o_w, c10::nullopt, hidden);
  torch::Tensor h2, res2;
  std::tie(h2, res2) = add_rms_norm(attn, res, post_norm, eps);
  auto mlp = lin(silu_and_mul(lin(h2, gate_up_w, c10::nullopt, 2 * inter)), down_w,
                 c10::nullopt, hidden);
  return {mlp, res2};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve AVX2/FMA CPU kernels; see kvserve/ops/cpu.py";
  // Kernels run without the GIL: the server's event loop thread keeps answering HTTP while
  // the engine thread is inside a forward pass (torch's own ops release it the same way).
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &linear, "small-M linear", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("avx512") = false, nogil());
  m.def("qlinear", &qlinear, "packed GGUF weight x int8-quantized activations",
        py::arg("x"), py::arg("weight"), py::arg("N"), py::arg("bias"),
        py::arg("avx512") = false, nogil());
  m.def("quantize_acts", &quantize_acts, "activations -> int8 per 32 (q, d, s, sum)", nogil());
  m.def("cpu_has_avx512_vnni", &kvs::cpu_has_avx512_vnni, "AVX-512 VNNI + BW usable");
  m.def("dequantize", &dequantize, "GGUF Q4_1 / Q8_0 rows -> float32", py::arg("weight"),
        py::arg("K"), nogil());
  m.def("cpu_has_avx512", &kvs::cpu_has_avx512, "AVX-512F usable (CPU and OS)");
  m.def("paged_attention", &paged_attention, "varlen paged attention", nogil());
  m.def("write_kv", &write_kv, "scatter K/V into the paged cache", nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm", nogil());
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm", nogil());
  m.def("silu_and_mul", &silu_and_mul, "fused SiLU(gate) * up", nogil());
  m.def("rotary", &rotary, "rotate-half RoPE", nogil());
  m.def("llama_layer", &llama_layer, "one fused Llama decoder layer", nogil());
}
