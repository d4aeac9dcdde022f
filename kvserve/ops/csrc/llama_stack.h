// LlamaStack: a run of a Llama model's decoder layers in one call (llama_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "kernels.h"

class LlamaStack {
 public:
  // One linear's weight (bound as LinearWeights): its output rows in runs of one format
  // each, in order (kvserve.quant.base.KernelWeight; one run unless a fused projection mixes
  // formats, as a Q4_K_M file's qkv does). A run is float32 rows [rows, K] (wtype 0), GGUF
  // rows (uint8 [rows, row bytes]), packed groups (uint8 [groups, K / 32, record bytes]) or
  // packed K-quant groups (uint8 [groups, K / 256, record bytes]) in the format its wtype
  // names (a ggml type id: kvs::WType or kvs::KType). perm: the order of the inputs the
  // weight's columns hold (GPTQ act-order, KernelWeight.perm): int64 [K], x gathered in it
  // first; none for the inputs in order.
  struct LinearWeights {
    std::vector<torch::Tensor> parts;
    std::vector<int64_t> wtypes, rows;
    c10::optional<torch::Tensor> perm;
  };
  // One layer, as CpuOps._fusable fills it (bound to Python as LayerWeights, by name). The
  // weights are checked here, once, and kept alive.
  struct LayerWeights {
    torch::Tensor in_norm, post_norm;  // float32 [hidden]
    double eps = 0;
    LinearWeights qkv, o, gate_up, down;
    c10::optional<torch::Tensor> qkv_bias;
    int64_t heads = 0, kv_heads = 0, head_dim = 0;
    double scale = 0;  // attention's, usually head_dim ** -0.5
  };

  // all_reduce: tensor parallelism's communication hook, None in one process. A Python
  // callable that sums a [T, hidden] float32 tensor over the ranks in place
  // (kvserve.distributed.group.TPGroup.all_reduce), called after each layer's o_proj and
  // down_proj, where the Python layer's row-parallel Linear calls it: the same order, so the
  // same bits. It runs with the GIL taken back (forward releases it).
  // amx: K-quant linears of 4+ rows on AMX tiles (the same bits; needs avx512).
  LlamaStack(const std::vector<LayerWeights>& layers, bool avx512, int64_t small_m,
             pybind11::object all_reduce = pybind11::none(), bool amx = false);

  // x [T, hidden] through every layer -> (mlp out, residual) of the last one, as the Python
  // layers return them. residual: the stream so far (none before a model's first layer).
  // kv_cache holds every layer of the stack, [L, 2, num_blocks, block_size, Hkv, D]; a
  // quantized one (int8 / uint8 fp8 bits) comes with kv_scales [L, 2, num_blocks,
  // block_size, Hkv] float32.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
      const torch::Tensor& positions, const torch::Tensor& cos_sin,
      torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
      const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
      const torch::Tensor& query_start_loc,
      const c10::optional<torch::Tensor>& kv_scales = c10::nullopt) const;

 private:
  struct Part {
    enum Kind { kRows, kPacked, kKPacked } kind;  // linear / qlinear / qlinear_kquant
    torch::Tensor w;
    int wtype;  // the kvs::WType or kvs::KType its kind takes
    int64_t start, N;  // output rows [start, start + N)
  };
  struct Linear {
    std::vector<Part> parts;
    c10::optional<torch::Tensor> bias;
    int64_t N, K;
    c10::optional<torch::Tensor> perm;  // LinearWeights.perm, checked
  };
  struct Layer {
    torch::Tensor in_norm, post_norm;
    double eps, scale;
    int64_t heads, kv_heads, head_dim, hidden, inter;
    Linear qkv, o, gate_up, down;
  };

  static Linear make_linear(const LinearWeights& w, const c10::optional<torch::Tensor>& b,
                            int64_t N, int64_t K, const char* name);
  // out [M, l.N] = x [M, l.K] times the linear; a run of several parts writes each part's
  // rows through tmp ([M, widest part]) unless M is 1. With a perm, x's columns are gathered
  // in its order first, into gathered ([M, widest permuted K]).
  void linear(const Linear& l, const float* x, int64_t M, float* out, float* tmp,
              float* gathered, int nthreads) const;
  void run_part(const Part& p, int64_t K, const float* x, int64_t M, const float* bias,
                float* out, int nthreads) const;

  std::vector<Layer> layers_;
  pybind11::object all_reduce_;
  // The widest layer's qkv, q, k and MLP widths: the scratch per token.
  int64_t w_qkv_ = 0, w_q_ = 0, w_k_ = 0, w_i_ = 0;
  // The widest part of a linear that has several (0: none has), for linear's tmp; the
  // widest K of a linear with a perm (0: none has one), for its gathered inputs.
  int64_t w_part_ = 0, w_perm_ = 0;
  bool avx512_, vnni_, amx_;
  int64_t small_m_;
};
