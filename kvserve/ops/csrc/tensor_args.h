// Tensor-level argument checks and raw-kernel glue shared by bindings.cpp (one op per call)
// and llama_stack.cpp (all of a model's decoder layers per call): every precondition the raw
// kernels (kernels.h) rely on is checked here, once, with a message naming the argument.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "kernels.h"

namespace kvs_args {

inline void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

inline void check_inner(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// One layer of the paged cache, [2, num_blocks, block_size, Hkv, D]: float32, float16, or
// quantized (int8, or uint8 holding fp8 e4m3fn bits) with its scales [2, num_blocks,
// block_size, Hkv] float32 (kernels.h AttentionArgs); returns its element type. The scales
// are required exactly when the cache is quantized.
inline kvs::KVType check_kv_cache(const torch::Tensor& kv_cache,
                                  const c10::optional<torch::Tensor>& kv_scales = c10::nullopt) {
  const auto st = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.device().is_cpu() &&
                  (st == torch::kFloat32 || st == torch::kFloat16 || st == torch::kInt8 ||
                   st == torch::kUInt8),
              "kv_cache must be a float32, float16, int8 or uint8 (fp8 e4m3fn bits) CPU "
              "tensor, got ", st, " on ", kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be one contiguous layer [2, num_blocks, block_size, Hkv, D], got ",
              kv_cache.sizes());
  const kvs::KVType kt = st == torch::kFloat16 ? kvs::KVType::F16
                         : st == torch::kInt8  ? kvs::KVType::I8
                         : st == torch::kUInt8 ? kvs::KVType::FP8_E4M3
                                               : kvs::KVType::F32;
  TORCH_CHECK(kvs::kv_quantized(kt) == kv_scales.has_value(),
              kvs::kv_quantized(kt) ? "an int8 / fp8 kv_cache needs its kv_scales"
                                    : "kv_scales are for an int8 / fp8 kv_cache only, got a ",
              kvs::kv_quantized(kt) ? "" : c10::toString(st), " cache");
  if (kv_scales.has_value()) {
    const auto& sc = *kv_scales;
    TORCH_CHECK(sc.device().is_cpu() && sc.scalar_type() == torch::kFloat32 &&
                    sc.is_contiguous() && sc.sizes() == kv_cache.sizes().slice(0, 4),
                "kv_scales must be contiguous float32 ", kv_cache.sizes().slice(0, 4),
                " (one per K / V row per kv head), got ", sc.scalar_type(), " ", sc.sizes());
  }
  return kt;
}

// The scales of the K and V halves of a checked quantized layer; null for a float cache.
inline std::pair<float*, float*> kv_scale_ptrs(const c10::optional<torch::Tensor>& kv_scales) {
  if (!kv_scales.has_value()) return {nullptr, nullptr};
  float* k = kv_scales->data_ptr<float>();
  return {k, k + kv_scales->stride(0)};
}

// The V half of a checked kv_cache layer: K's data pointer plus stride(0) elements.
inline void* v_cache_ptr(const torch::Tensor& kv_cache) {
  return static_cast<char*>(kv_cache.data_ptr()) + kv_cache.stride(0) * kv_cache.element_size();
}

inline torch::Tensor as_int32(const torch::Tensor& t) {
  return t.scalar_type() == torch::kInt32 ? t.contiguous() : t.to(torch::kInt32).contiguous();
}

inline torch::Tensor as_int64(const torch::Tensor& t) {
  return t.scalar_type() == torch::kInt64 ? t.contiguous() : t.to(torch::kInt64).contiguous();
}

// Whether a ggml type id names a format the kernels take (kernels.h WType).
inline bool known_wtype(int64_t wtype) {
  return wtype == 0 || wtype == 1 || wtype == 2 || wtype == 3 || wtype == 6 || wtype == 7 ||
         wtype == 8 || wtype == 20 || wtype == 30 || wtype == 256 || wtype == 263;
}

// The ggml type id the caller names -> a format the kernels take.
inline kvs::WType weight_format(int64_t wtype) {
  TORCH_CHECK(known_wtype(wtype),
              "wtype must be 0 (F32), 1 (F16), 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), "
              "20 (IQ4_NL), 30 (BF16), 256 (W8A8) or 263 (Q4_1_128), got ", wtype);
  return static_cast<kvs::WType>(wtype);
}

// A weight [N, row bytes] in the named format: float32 rows, or uint8 GGUF blocks whose row
// length must be that format's for K weights.
inline kvs::WType checked_weight_type(const torch::Tensor& weight, int64_t wtype, int64_t K) {
  TORCH_CHECK(kvs::is_row_format(static_cast<kvs::WType>(wtype)),
              "wtype must be 0 (F32), 1 (F16), 3 (Q4_1), 8 (Q8_0) or 30 (BF16) for a weight "
              "read as rows, got ",
              wtype,
              known_wtype(wtype)  // a kernel format, but not a row one
                  ? " (Q4_0 / Q5_0 / Q5_1 / IQ4_NL / W8A8 / Q4_1_128 run packed only: qlinear)"
                  : "");
  const kvs::WType wt = weight_format(wtype);
  if (wt == kvs::WType::F32 || kvs::is_half_format(wt)) {  // float rows [N, K]
    const bool f16 = wt == kvs::WType::F16, f32 = wt == kvs::WType::F32;
    const auto want = f32 ? torch::kFloat32 : f16 ? torch::kFloat16 : torch::kBFloat16;
    TORCH_CHECK(weight.scalar_type() == want, "a wtype ", wtype, " (",
                f32 ? "F32" : f16 ? "F16" : "BF16", ") weight must be ",
                f32 ? "float32" : f16 ? "float16" : "bfloat16", ", got ", weight.scalar_type());
    TORCH_CHECK(weight.size(1) == K, "weight [N, K] has K=", weight.size(1), ", x has ", K);
    TORCH_CHECK(wt == kvs::WType::F32 || K % 16 == 0,
                "a float16 / bfloat16 weight needs K % 16 == 0, got K=", K);
    return wt;
  }
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8,
              "a quantized weight (wtype ", wtype, ") must be uint8 GGUF blocks, got ",
              weight.scalar_type());
  TORCH_CHECK(K % 32 == 0, "a quantized weight needs K % 32 == 0, got K=", K);
  TORCH_CHECK(weight.size(1) == kvs::row_bytes(wt, K), "wtype ", wtype, " rows of K=", K,
              " weights take ", kvs::row_bytes(wt, K), " bytes, the weight has ",
              weight.size(1));
  return wt;
}

// A packed weight [ceil(N / 16), K / 32, 16 x block bytes] (kvserve/quant/block_pack.py pack) in
// the named block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; Q4_1_128's records hold 4
// blocks), for K inputs and N outputs.
inline kvs::WType checked_packed_type(const torch::Tensor& weight, int64_t wtype, int64_t K,
                                      int64_t N) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kUInt8 &&
                  weight.dim() == 3 && weight.is_contiguous(),
              "a packed weight is a contiguous uint8 [groups, K / 32 (K / 128: Q4_1_128), "
              "record bytes] tensor, got ",
              weight.scalar_type(), " ", weight.sizes());
  const kvs::WType wt = weight_format(wtype);
  TORCH_CHECK(wt != kvs::WType::F32 && !kvs::is_half_format(wt),
              "a packed weight needs a block format, got wtype ", wtype);
  const kvs::PackedFormat f = kvs::packed_format(wt);
  TORCH_CHECK(weight.size(2) == f.record, "packed wtype ", wtype, " records take ", f.record,
              " bytes, the weight's have ", weight.size(2));
  TORCH_CHECK(K == weight.size(1) * 32 * f.span, "x [M, K] must have K = ",
              weight.size(1) * 32 * f.span, " for this packed weight, got K=", K);
  TORCH_CHECK(N > 16 * (weight.size(0) - 1) && N <= 16 * weight.size(0), "N=", N,
              " does not fit ", weight.size(0), " groups of 16 rows");
  return wt;
}

// bias [N] float32 contiguous, or none.
inline const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "bias must be [", N, "]");
  return bias->data_ptr<float>();
}

// out[M, N] = x (quantized to int8 per 32 values) times a checked packed weight (kernels.h
// qlinear). The quantized activations live in per-thread buffers that only grow: a decode
// step makes ~120 of these calls, and four tensor allocations each cost more than quantizing
// a row.
inline void quantized_linear(const float* x, int64_t ldx, int64_t M, int64_t K,
                             const uint8_t* w, kvs::WType wt, const float* bias, float* out,
                             int64_t N, bool avx512, int nthreads) {
  TORCH_CHECK(!avx512 || kvs::cpu_has_avx512_vnni(),
              "qlinear(avx512=True) on a CPU without AVX-512 VNNI");
  if (M == 0) return;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> sum;
  if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
  if (static_cast<int64_t>(d.size()) < M * K / 32) {
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    sum.resize(M * K / 32);
  }
  // W8A8: the Q8_0 kernels against activations quantized per token.
  const bool per_token = wt == kvs::WType::W8A8;
  (per_token ? kvs::quantize_acts_per_token : kvs::quantize_acts)(x, ldx, M, K, q.data(),
                                                                   d.data(), s.data(),
                                                                   sum.data(), nthreads);
  const kvs::QActs a{q.data(), d.data(), s.data(), sum.data(), M, K};
  (avx512 ? kvs::qlinear_avx512 : kvs::qlinear)(a, w, per_token ? kvs::WType::Q8_0 : wt, bias,
                                                out, N, nthreads);
}

// GGUF rows of K weights in the named format -> float32 [N, K], the kernels' values; a
// float32 weight as it is, a float16 / bfloat16 one widened (exactly).
inline torch::Tensor dequantize_weight(const torch::Tensor& weight, int64_t wtype, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous 2-D CPU tensor");
  const kvs::WType wt = checked_weight_type(weight, wtype, K);
  if (wt == kvs::WType::F32) return weight;
  if (kvs::is_half_format(wt)) return weight.to(torch::kFloat32);  // exact
  auto out = torch::empty({weight.size(0), K}, weight.options().dtype(torch::kFloat32));
  kvs::dequantize_rows(weight.data_ptr(), wt, out.data_ptr<float>(), weight.size(0), K,
                       at::get_num_threads());
  return out;
}

// Positions [T] (any integer type) as int64, each checked to lie in cos_sin's [max_pos, D].
inline torch::Tensor checked_positions(const torch::Tensor& positions, int64_t T,
                                       const torch::Tensor& cos_sin) {
  check_f32(cos_sin, "cos_sin");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(1) % 2 == 0,
              "cos_sin must be contiguous [max_pos, D] with D even");
  auto pos = as_int64(positions);
  TORCH_CHECK(pos.numel() == T, "positions has ", pos.numel(), " entries for ", T, " tokens");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos_sin.size(0), "position ", p[t], " outside [0, ",
                cos_sin.size(0), ")");
  return pos;
}

// slot_mapping [T] as int64, each slot checked to lie below num_slots (negative: skipped).
inline torch::Tensor checked_slots(const torch::Tensor& slot_mapping, int64_t T,
                                   int64_t num_slots) {
  auto slots = as_int64(slot_mapping);
  TORCH_CHECK(slots.numel() == T, "slot_mapping has ", slots.numel(), " slots for ", T,
              " tokens");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is past the cache's ", num_slots, " slots");
  return slots;
}

// The attention metadata of T query tokens, as int32, checked against each other and against
// the block size: the kernel trusts these bounds, and checking them costs O(B).
struct AttentionMeta {
  torch::Tensor block_tables, seq_lens, query_start_loc;
  int64_t B;
};
inline AttentionMeta checked_attention_meta(const torch::Tensor& block_tables,
                                            const torch::Tensor& seq_lens,
                                            const torch::Tensor& query_start_loc, int64_t T,
                                            int64_t block_size) {
  AttentionMeta m{as_int32(block_tables), as_int32(seq_lens), as_int32(query_start_loc), 0};
  m.B = m.seq_lens.numel();
  const auto& bt = m.block_tables;
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) >= m.B && m.query_start_loc.numel() == m.B + 1,
              "block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1] disagree: ",
              bt.sizes(), ", ", m.seq_lens.sizes(), ", ", m.query_start_loc.sizes());
  const int32_t* s = m.seq_lens.data_ptr<int32_t>();
  const int32_t* qs = m.query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[m.B] == T, "query_start_loc must run from 0 to T=", T);
  for (int64_t b = 0; b < m.B; ++b) {
    const int64_t ql = qs[b + 1] - qs[b];
    TORCH_CHECK(ql >= 0 && ql <= s[b], "request ", b, " has ", ql, " queries but seq_len ",
                s[b]);
    TORCH_CHECK((s[b] + block_size - 1) / block_size <= bt.size(1), "request ", b,
                " seq_len ", s[b], " needs more blocks than block_tables has columns");
  }
  return m;
}

// AttentionArgs for q (strides q_st, q_sh) over one cache layer's K and V halves.
// Scales (k_scales, v_scales): a quantized cache's, else null.
inline kvs::AttentionArgs attention_args(const float* q, int64_t q_st, int64_t q_sh,
                                         const void* k_cache, const void* v_cache,
                                         kvs::KVType kv_type,
                                         const AttentionMeta& m, float* out, int64_t H,
                                         int64_t Hkv, int64_t D, int64_t block_size,
                                         double scale,
                                         std::pair<const float*, const float*> scales = {}) {
  kvs::AttentionArgs a;
  a.q = q;
  a.q_st = q_st;
  a.q_sh = q_sh;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.kv_type = kv_type;
  a.k_scales = scales.first;
  a.v_scales = scales.second;
  a.block_tables = m.block_tables.data_ptr<int32_t>();
  a.bt_stride = m.block_tables.stride(0);
  a.seq_lens = m.seq_lens.data_ptr<int32_t>();
  a.query_start_loc = m.query_start_loc.data_ptr<int32_t>();
  a.out = out;
  a.B = m.B;
  a.H = H;
  a.Hkv = Hkv;
  a.D = D;
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  return a;
}

// --- packed GGUF K-quants (kernels.h qlinear_kquant) ---

// Whether the ggml type id names a K-quant format the packed kernels take.
inline bool is_kquant(int64_t wtype) {
  switch (wtype) {
    case static_cast<int>(kvs::KType::Q2_K):
    case static_cast<int>(kvs::KType::Q3_K):
    case static_cast<int>(kvs::KType::Q4_K):
    case static_cast<int>(kvs::KType::Q5_K):
    case static_cast<int>(kvs::KType::Q6_K):
    case static_cast<int>(kvs::KType::IQ4_XS):
    case static_cast<int>(kvs::KType::IQ3_S4):
    case static_cast<int>(kvs::KType::IQ3_XXS4):
    case static_cast<int>(kvs::KType::IQ2_XXS4):
    case static_cast<int>(kvs::KType::IQ1_S4):
    case static_cast<int>(kvs::KType::IQ2_X16):
    case static_cast<int>(kvs::KType::IQ1_M16):
      return true;
    default:
      return false;
  }
}

// The ggml type id the caller names -> a K-quant format the packed kernels take.
inline kvs::KType kquant_format(int64_t wtype) {
  TORCH_CHECK(is_kquant(wtype),
              "a packed K-quant wtype must be 10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), "
              "14 (Q6_K), 23 (IQ4_XS), 257 (IQ3_S4), 258 (IQ3_XXS4), 259 (IQ2_XXS4), 260 "
              "(IQ1_S4), 261 (IQ2_X16) or 262 (IQ1_M16), got ", wtype);
  return static_cast<kvs::KType>(wtype);
}

// A packed K-quant weight [ceil(N / 16), K / 256, 16 x record bytes] (kvserve/quant/
// kquant_pack.py pack_kquant) in the named format, for K inputs and N outputs.
inline kvs::KType checked_kquant_type(const torch::Tensor& weight, int64_t wtype, int64_t K,
                                      int64_t N) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kUInt8 &&
                  weight.dim() == 3 && weight.is_contiguous(),
              "a packed K-quant weight is a contiguous uint8 [groups, K / 256, record bytes] "
              "tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const kvs::KType kt = kquant_format(wtype);
  const int64_t rb = kvs::kquant_record_bytes(kt);
  TORCH_CHECK(weight.size(2) == rb, "packed wtype ", wtype, " records take ", rb,
              " bytes, the weight's have ", weight.size(2));
  TORCH_CHECK(weight.size(1) > 0 && K == weight.size(1) * 256, "x [M, K] must have K = ",
              weight.size(1) * 256, " for this packed weight, got K=", K);
  TORCH_CHECK(N > 16 * (weight.size(0) - 1) && N <= 16 * weight.size(0), "N=", N,
              " does not fit ", weight.size(0), " groups of 16 rows");
  return kt;
}

// out[M, N] = x (quantized to Q8_K) times a checked packed K-quant weight. The activations
// live in per-thread buffers that only grow, as quantized_linear's.
inline void kquant_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
                          kvs::KType kt, const float* bias, float* out, int64_t N, bool avx512,
                          bool amx, int nthreads) {
  TORCH_CHECK(!avx512 || kvs::cpu_has_avx512_vnni(),
              "qlinear_kquant(avx512=True) on a CPU without AVX-512 VNNI");
  TORCH_CHECK(!amx || (avx512 && kvs::cpu_has_amx_int8()),
              "qlinear_kquant(amx=True) needs avx512=True and a CPU with AMX-INT8");
  if (M == 0) return;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> bsums;
  if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
  if (static_cast<int64_t>(bsums.size()) < M * K / 16) {
    d.resize(M * K / 256);
    bsums.resize(M * K / 16);
  }
  kvs::quantize_acts_q8k(x, ldx, M, K, q.data(), d.data(), bsums.data(), nthreads);
  const kvs::Q8KActs a{q.data(), d.data(), bsums.data(), M, K};
  if (avx512) kvs::qlinear_kquant_avx512(a, w, kt, bias, out, N, nthreads, amx);
  else kvs::qlinear_kquant(a, w, kt, bias, out, N, nthreads);
}

}  // namespace kvs_args
