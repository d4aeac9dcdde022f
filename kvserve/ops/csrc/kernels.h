// Raw-pointer kernel entry points. The kernel sources include no torch header (they compile
// in seconds); bindings.cpp owns every tensor check and calls these.
//
// Conventions: fp32 data, innermost dimension contiguous, other strides given in elements.
// `nthreads` is torch's intra-op thread count, so the kernels share torch's OpenMP pool size.
#pragma once

#include <cstdint>

namespace kvs {

// The weight formats linear reads, numbered as ggml numbers them. A quantized row is K / 32
// blocks of 32 weights (K % 32 == 0), each dequantized exactly as gguf-py does, one fp32
// rounding per operation: Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; weight j is
// d * (qs[j] & 15) + m, weight 16 + j is d * (qs[j] >> 4) + m) and Q8_0 (34 bytes: fp16 d,
// 32 int8 q; weight j is d * q[j]).
// The caller names the format (kvserve's LinearMethod knows it): a row length cannot tell
// formats apart (Q4_0 and Q4_K both take 0.5625 bytes per weight). Q4_0, Q5_0, Q5_1 and
// IQ4_NL are packed formats only (qlinear below): no row kernel reads them.
// W8A8 is kvserve's own id (past ggml's): Q8_0 records whose blocks all carry their row's
// scale (per output channel), run against activations quantized per token (one scale per
// row, quantize_acts_per_token): SmoothQuant's W8A8 on the Q8_0 kernels.
// F16 and BF16 are float rows of half the bytes, widened exactly to float32 in registers.
// Q4_1_128 (kvserve's own, past the KType ids) is Q4_1 packed with one d and m per 4 blocks
// (128 weights), as a GPTQ / AWQ / int4 group of 128 has them: packed only.
enum class WType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, BF16 = 30,
  W8A8 = 256, Q4_1_128 = 263
};
// IQ4_NL's and IQ4_XS's 16 weight values (ggml's kvalues_iq4nl), indexed by a stored nibble.
// The kernels look them up with a byte shuffle; VNNI takes them + 128 (1..241, unsigned:
// each byte ^ 0x80) and takes back 128 x the activations' sum.
alignas(16) inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                       1,    13,   25,  38,  53,  69,  89,  113};
inline bool is_row_format(WType wt) {
  return wt == WType::F32 || wt == WType::F16 || wt == WType::BF16 || wt == WType::Q4_1 ||
         wt == WType::Q8_0;
}
inline bool is_half_format(WType wt) { return wt == WType::F16 || wt == WType::BF16; }
int64_t row_bytes(WType wt, int64_t K);  // bytes of one row of K weights; a row format only

// The KV cache's element type. I8 and FP8_E4M3 are quantized: int8 (-127..127) or the e4m3fn
// bit pattern (one byte each), with one float32 scale per K / V row of each kv head beside
// the cache (kvserve/kv/layout.py); an element stands for float(q) * scale.
enum class KVType : int { F32 = 0, F16 = 1, I8 = 2, FP8_E4M3 = 3 };
inline bool kv_quantized(KVType t) { return t == KVType::I8 || t == KVType::FP8_E4M3; }
// The 256-entry decode table: e4m3fn bits -> float, exactly torch.float8_e4m3fn's values
// (0x7f / 0xff are NaN, which write_kv never stores for finite inputs).
const float* fp8_e4m3_table();
// float -> e4m3fn bits as torch's .to(torch.float8_e4m3fn) rounds (c10's
// fp8e4m3fn_from_fp32_value): to nearest even; |x| above 464 (halfway from 448, the largest
// finite, to the NaN code) and NaN give 0x7f | sign.
uint8_t float_to_fp8_e4m3(float f);

// out[m, n] = sum_k x[m*ldx + k] * w(n, k) (+ bias[n]);  out is [M, N] contiguous; w is N rows
// of row_bytes(wt, K) bytes. A quantized row gives the float32 kernel's result on its
// dequantized row bit for bit: the same values in the same FMA order.
void linear_small_m(const float* x, int64_t ldx, const void* w, WType wt, const float* bias,
                    float* out, int64_t M, int64_t N, int64_t K, int nthreads);
// The same with AVX-512F (linear_avx512.cpp). Precondition: cpu_has_avx512(). Both give each
// out[m, n] independently of M and of row m's place in the batch (bit for bit, per ISA).
void linear_small_m_avx512(const float* x, int64_t ldx, const void* w, WType wt,
                           const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                           int nthreads);
bool cpu_has_avx512();
// N quantized rows -> float32 [N, K], the values the kernels compute with.
void dequantize_rows(const void* w, WType wt, float* out, int64_t N, int64_t K, int nthreads);

// Activation rows quantized per block of 32 values (llama.cpp's Q8_1 scheme), for qlinear:
// d = amax / 127, q = round-half-even(x * (127 / amax)) (0 when amax == 0), sum = sum(q),
// s = d * (float)sum. See quantize_activations in kvserve/quant/block_pack.py. The quants lie in
// [-127, 127] (never -128), which the AVX2 kernel's sign trick relies on.
struct QActs {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K / 32]
  const float* s;      // [M, K / 32]
  const int32_t* sum;  // [M, K / 32]
  int64_t M, K;
};
void quantize_acts(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d,
                   float* s, int32_t* sum, int nthreads);
// The same layout with one scale per row (W8A8's per-token activations): amax over the whole
// row, every block of row m getting d = amax / 127 and its quants x * (127 / amax) rounded
// half to even; s and sum per block as above. See quantize_activations_per_token in
// kvserve/quant/block_pack.py.
void quantize_acts_per_token(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q,
                             float* d, float* s, int32_t* sum, int nthreads);

// One packed record (16 rows x one block of 32 weights) of a block format, byte offsets of
// its fields (-1: absent); kvserve/quant/block_pack.py draws the layout. d (and m) are fp16[16];
// a chunk is 64 bytes, byte 4r + j of row r; a quant is stored unsigned, as q + offset.
//   nibbles: 4 chunks at qs, chunk c = quant 4c + j (low nibble), 16 + 4c + j (high)
//   qh >= 0: a 64-byte plane, byte 4r + j bit b = bit 4 of quant 4b + j (the 5-bit types)
//   lookup (IQ4_NL): a nibble is an index; the quant is kIQ4Values[nibble], and offset the
//     128 VNNI adds to it (the AVX2 kernel multiplies the signed values)
//   else (Q8_0): 8 chunks at qs, chunk c = quant 4c + j + 128 as uint8
//   span > 1 (Q4_1_128): one record holds span blocks, their d and m once and block j's
//     4 chunks at qs + 256 j; block_record() finds where block b's scales and chunks are
struct PackedFormat {
  int64_t record, m, qh, qs;
  int32_t offset;
  bool nibbles, lookup;
  int64_t span = 1;
};
constexpr PackedFormat packed_format(WType wt) {
  switch (wt) {
    case WType::Q4_0: return {288, -1, -1, 32, 8, true, false};
    case WType::Q4_1: return {320, 32, -1, 64, 0, true, false};
    case WType::Q4_1_128: return {1088, 32, -1, 64, 0, true, false, 4};
    case WType::Q5_0: return {352, -1, 32, 96, 16, true, false};
    case WType::Q5_1: return {384, 32, 64, 128, 0, true, false};
    case WType::IQ4_NL: return {288, -1, -1, 32, 128, true, true};
    default: return {544, -1, -1, 32, 128, false, false};  // Q8_0
  }
}
// Bytes of one group's records (16 rows x K weights).
constexpr int64_t packed_group_bytes(const PackedFormat& f, int64_t K) {
  return K / (32 * f.span) * f.record;
}
// Block b of a group whose records start at gw: (its record's start, where its d / m are;
// the pointer its chunks are at + f.qs from). The same for span 1.
struct BlockRecord {
  const uint8_t *scales, *quants;
};
constexpr BlockRecord block_record(const PackedFormat& f, const uint8_t* gw, int64_t b) {
  const uint8_t* rec = gw + b / f.span * f.record;
  return {rec, rec + b % f.span * 4 * 64};  // a nibble block's 4 chunks of 64 bytes
}

// out[m, n] (n < N; out [M, N] contiguous) from a packed weight w of a block format:
// ceil(N / 16) groups of 16 rows, each K / 32 records of packed_format(wt).record bytes
// (K / 128 for Q4_1_128, which computes as Q4_1 on its blocks).
// Per (m, n), over blocks b in order, one fp32 rounding per op:
//   isum = sum_i qw[n, b, i] * q[m, b, i]   (exact, int32; qw signed: stored - offset)
//   acc  = acc + (float)isum * (dw[n, b] * d[m, b])
//   acc  = acc + mw[n, b] * s[m, b]          (Q4_1, Q5_1 only)
// then out = acc + bias[n] when bias is given. Every tile shape and ISA gives these bits, so
// the result depends on neither M nor the CPU.
void qlinear(const QActs& a, const uint8_t* w, WType wt, const float* bias, float* out,
             int64_t N, int nthreads);  // AVX2 (qlinear.cpp)
void qlinear_avx512(const QActs& a, const uint8_t* w, WType wt, const float* bias, float* out,
                    int64_t N, int nthreads);  // AVX-512 VNNI (qlinear_avx512.cpp)
bool cpu_has_avx512_vnni();

struct AttentionArgs {
  const float* q;        // q[t*q_st + h*q_sh + d]
  int64_t q_st, q_sh;
  // [num_blocks, block_size, Hkv, D] contiguous, float or IEEE half (torch.float16) as
  // kv_type says; a half is widened exactly, so it gives an fp32 cache's output on its values.
  // A quantized type (I8, FP8_E4M3): each element is widened exactly and multiplied by its
  // row's scale (one fp32 rounding), so it gives an fp32 cache's output on the dequantized
  // values bit for bit.
  const void* k_cache;
  const void* v_cache;  // same shape and type
  KVType kv_type;
  // Quantized types only (else null): [num_blocks, block_size, Hkv] contiguous float32.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  const int32_t* block_tables;  // [B, bt_stride]
  int64_t bt_stride;
  const int32_t* seq_lens;         // [B]
  const int32_t* query_start_loc;  // [B + 1]
  float* out;  // [T, H, D] contiguous
  int64_t B, H, Hkv, D, block_size;
  float scale;
};
void paged_attention(const AttentionArgs& a, int nthreads);

// dst[slot[t]] = src[t] for k and v, rows of Hkv*D elements; slot < 0 skipped. The cache
// holds floats, or IEEE halves (KVType::F16) rounded to nearest even as torch's .to(float16)
// does. A quantized type writes, per token and kv head, scale = amax / qmax (127 for I8, 448
// for FP8_E4M3) to k_scales / v_scales[slot * Hkv + h] and q = x / scale (I8: rounded half
// to even, clamped to +-127; FP8_E4M3: float_to_fp8_e4m3), 0 for an all-zero row: the bytes
// and scales of kvserve/ops/reference.py quantize_kv bit for bit.
void write_kv(const float* key, int64_t k_st, int64_t k_sh, const float* value, int64_t v_st,
              int64_t v_sh, void* k_cache, void* v_cache, KVType kv, float* k_scales,
              float* v_scales, const int64_t* slots, int64_t T, int64_t Hkv, int64_t D);

// Row-wise over [rows, n]; x rows have stride ldx, outputs are contiguous.
void rms_norm(const float* x, int64_t ldx, const float* w, float* out, int64_t rows, int64_t n,
              float eps, int nthreads);
// res_out = x + residual; out = rms_norm(res_out) * w.
void add_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr,
                  const float* w, float* out, float* res_out, int64_t rows, int64_t n,
                  float eps, int nthreads);
// x rows = [gate(n) | up(n)] -> out = silu(gate) * up, out [rows, n].
void silu_and_mul(const float* x, int64_t ldx, float* out, int64_t rows, int64_t n,
                  int nthreads);
// x[t*st + h*sh + d] rotated at positions[t] -> out [T, heads, D] contiguous.
void rotary(const float* x, int64_t st, int64_t sh, float* out, int64_t T, int64_t heads,
            int64_t D, const int64_t* positions, const float* cos_sin, int64_t max_pos,
            int nthreads);

// --- GGUF K-quants kept packed (qlinear_kquant*.cpp, issue 11) ---
// The K-quant formats the packed kernels take, numbered as ggml numbers them (the caller names
// the format, as for WType). Their records are 16 rows x one 256-weight super-block
// (kquant.h; kvserve/quant/kquant_pack.py pack_kquant). IQ4_XS has their shape (8 sub-blocks
// of 32 with a 6-bit scale, no min), its quants a lookup into 16 fixed values (kIQ4Values).
// IQ3_S4, IQ3_XXS4, IQ2_XXS4 and IQ1_S4 (kvserve's own ids, past ggml's) are a file's IQ3_S,
// IQ3_XXS, IQ2_XXS and IQ1_S rewritten exactly in IQ4_XS's layout, their nibbles indexing
// their own tables below, IQ3_XXS4's d scaled by 1/4, IQ2_XXS4's and IQ1_S4's by 1/8
// (kvserve/quant/ggml_kquants.py rewrite_iq4, IQ4_FAMILY). IQ2_X16 is a file's IQ2_XS or IQ2_S,
// whose scales are per 16 weights: IQ2_XXS4's values and factor, 16 int8 scales (kquant.h);
// IQ1_M16 a file's IQ1_M, the same record with IQ1_S4's values and factor.
enum class KType : int {
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23,
  IQ3_S4 = 257, IQ3_XXS4 = 258, IQ2_XXS4 = 259, IQ1_S4 = 260, IQ2_X16 = 261, IQ1_M16 = 262
};
// The i-quants' grid values with their signs (gguf-py's grid_map): IQ3_S 1, 3, .., 15;
// IQ3_XXS 4, 12, .., 52, 62; IQ2_XXS 8, 25, 43; IQ1_S 8 g +- 1 for g in -1, 0, 1 (the last two:
// 10 unused zeros between).
alignas(16) inline constexpr int8_t kIQ3SValues[16] = {-15, -13, -11, -9, -7, -5, -3, -1,
                                                        1,   3,   5,   7,  9,  11, 13, 15};
alignas(16) inline constexpr int8_t kIQ3XXSValues[16] = {-62, -52, -44, -36, -28, -20, -12, -4,
                                                          4,   12,  20,  28,  36,  44,  52, 62};
alignas(16) inline constexpr int8_t kIQ2XXSValues[16] = {-43, -25, -8, 0, 0, 0, 0, 0,
                                                          0,   0,   0,  0, 0, 8, 25, 43};
alignas(16) inline constexpr int8_t kIQ1SValues[16] = {-9, -7, -1, 0, 0, 0, 0, 0,
                                                        0,  0,  0, 0, 0, 1, 7, 9};
// 1344 (Q2_K), 1760 (Q3_K), 2304 (Q4_K), 2816 (Q5_K), 3360 (Q6_K), 2176 (IQ4_XS and the
// four rewritten i-quants in its layout), 2336 (IQ2_X16, IQ1_M16)
int64_t kquant_record_bytes(KType kt);

// Activation rows as Q8_K per 256 values, llama.cpp's quantize_row_q8_K_ref: max = the value
// of largest |x| (the first on a tie), iscale = -127 / max, q = min(127, round-half-even(
// iscale * x)), d = 1 / iscale; a block of zeros gets d = 0, q = 0. bsums[j] = sum of
// q[16j, 16j + 16). See quantize_activations_q8_k in kvserve/quant/ggml_kquants.py.
// The quants lie in [-127, 127].
struct Q8KActs {
  const int8_t* q;        // [M, K]
  const float* d;         // [M, K / 256]
  const int16_t* bsums;   // [M, K / 16]
  int64_t M, K;
};
void quantize_acts_q8k(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d,
                       int16_t* bsums, int nthreads);

// out[m, n] (n < N; out [M, N] contiguous) from a packed K-quant weight w: ceil(N / 16)
// groups, each K / 256 records. Per (m, n), super-blocks i in order, every integer exact:
//   isum = sum_s scale_s * sum_{j in s} q[j] * qx[j]      msum = sum_s min_s * bsums over s
//   dw = d * xd_i,  dm = dmin * xd_i
//   sums = sums + dw * (float)isum;  mins = mins - dm * (float)msum   (Q4_K, Q5_K)
//   sums = sums + dw * (float)isum           (Q3_K, Q6_K, IQ4_XS and its layout's: no mins)
//   sums = sums + (dw * (float)isum - dm * (float)msum)                 (Q2_K)
// then out = mins + sums (+ bias[n]), one fp32 rounding per operation: ggml_kquants.py
// dot_kquant's order, so every ISA, tile and M give its bits.
void qlinear_kquant(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                    float* out, int64_t N, int nthreads);  // AVX2 (qlinear_kquant.cpp)
// VNNI, same bits; Q4_K, Q5_K, Q6_K and IQ4_XS at 32+ rows read each group's records unpacked
// once per pass ("wide records", as the AVX2 kernel's). amx: Q4_K, Q5_K and Q6_K at M >=
// kAmxMinRows run on AMX tiles instead (the same integer sums, so the same bits); only where
// cpu_has_amx_int8().
// Below 32 rows unpacking the weights for the tiles costs more than the tiles save.
void qlinear_kquant_avx512(const Q8KActs& a, const uint8_t* w, KType kt, const float* bias,
                           float* out, int64_t N, int nthreads, bool amx = false);
constexpr int64_t kAmxMinRows = 32;
// AMX-TILE and AMX-INT8 usable: the CPU has them and Linux granted this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once on the first call).
bool cpu_has_amx_int8();

}  // namespace kvs
