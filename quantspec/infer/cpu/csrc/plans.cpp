// The CPU room's model-shaped plans: a Llama decoder stack (`DecoderPlan`, infer/cpu/stack.py)
// and an MTP draft step (`MTPPlan`, infer/cpu/mtp_step.py), each in one call over quantspec's
// CPU kernels (kernels/csrc/cpu.h), compiled into the same extension.

#include <cmath>

#include "cpu.h"

// ---- a whole decoder stack in one call (decode / verification / short-prefill steps) --------
//
// A decode step of a small model on CPU spends much of its time in Python between kernels
// (about a dozen module calls and twenty tensor ops per layer). The plan holds each layer's norm weights, its four fused linears (packed fp32, int8 or int4) and
// its KV cache tensors, and runs the very calls the modules make, in their order: rms_norm,
// qkv linear, rope over q and k, paged attention (writing k / v), o linear, residual add,
// rms_norm, gate/up linear, silu * up, [the down linear's run-time input transform: SpinQuant's
// R4, its block linear over each block of the row, times 1/sqrt(block)], down linear, residual
// add. Same kernels, same operands: bitwise the module path's result.

namespace {

// kind 0: packed fp32 (a); 1: int8 (a = q, b = scale); 2: int4 (a = q, b = scale, c = neg_zs);
// 3: torch's packed int4 op for bf16 / fp16 x (a = int4pack, b = scales_zeros, bias in x's dtype
// added after it, as QuantLinear does); 4: FP4 weights, float inputs (a = E2M1 nibbles, b = scale);
// 5: bf16 packed in k-pairs for bf16 x (a)
struct LinearSpec {
  int64_t kind = 0, N = 0, group = 0;
  at::Tensor a, b, c;
  c10::optional<at::Tensor> bias;
};

at::Tensor run_linear(const LinearSpec& s, const at::Tensor& x, bool pairs) {
  switch (s.kind) {
    case 0: return packed_gemm(x, s.a, s.N, s.bias);
    case 1: return packed_w8_gemm(x, s.a, s.b, s.N, s.bias, pairs);
    case 2: return packed_w4_gemm(x, s.a, s.b, s.c, s.group, s.N, s.bias, pairs);
    case 4: return packed_fp4_gemm(x, s.a, s.b, s.group, s.N, s.bias, pairs);
    case 5: return packed_pairs_gemm(x, s.a, s.N, s.bias);
    default: {
      at::Tensor xa = x.contiguous();  // the op needs an allocator-aligned x (QuantLinear's _aligned)
      if (reinterpret_cast<uintptr_t>(xa.data_ptr()) % 64 != 0) xa = xa.clone();
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(xa, s.a, s.group, s.b);
      return s.bias.has_value() ? at::add(y, *s.bias) : y;
    }
  }
}

// one decoder layer's tensors: 22 tensors (norm_in, norm_post, then (a, b, c, bias) for qkv, o,
// gate_up, down and the down linear's input transform; an empty tensor where a linear has no
// b / c / bias) and 15 ints ((kind, N, group) per linear; kind -1: no input transform)
constexpr size_t kLayerTensors = 22, kLayerInts = 15;

struct LayerWeights {
  at::Tensor norm_in, norm_post;
  LinearSpec qkv, o, gate_up, down;
  bool has_down_in = false;
  LinearSpec down_in;  // [block, block]: each block of the down linear's input times it, then / sqrt(block)
};

LinearSpec make_linear(const at::Tensor* t, const int64_t* n, const char* who) {
  TORCH_CHECK(n[0] >= 0 && n[0] <= 5, who, ": linear kind must be 0 to 5");
  LinearSpec s;
  s.kind = n[0]; s.N = n[1]; s.group = n[2];
  s.a = t[0]; s.b = t[1]; s.c = t[2];
  if (t[3].numel()) s.bias = t[3];
  return s;
}

LayerWeights make_layer(const at::Tensor* t, const int64_t* n, int64_t H, int64_t KV, int64_t hd, const char* who) {
  LayerWeights w;
  w.norm_in = t[0];
  w.norm_post = t[1];
  w.qkv = make_linear(t + 2, n, who);
  w.o = make_linear(t + 6, n + 3, who);
  w.gate_up = make_linear(t + 10, n + 6, who);
  w.down = make_linear(t + 14, n + 9, who);
  w.has_down_in = n[12] >= 0;
  if (w.has_down_in) {
    w.down_in = make_linear(t + 18, n + 12, who);
    TORCH_CHECK(w.down_in.N > 0 && (w.gate_up.N / 2) % w.down_in.N == 0,
                who, ": the down linear's input transform must take whole blocks of its input");
  }
  TORCH_CHECK(w.qkv.N == (H + 2 * KV) * hd && w.gate_up.N % 2 == 0,
              who, ": qkv must give (H + 2 KV) * head_dim outputs, gate_up an even number");
  return w;
}

// the MLP half of a layer: x + down(silu(gate) * up)(rms_norm(x)), the down linear's input
// transformed first where it has one (infer/transformed.py's TransformedLinear: the same calls)
at::Tensor mlp_residual(const LayerWeights& w, const at::Tensor& x, double eps, bool pairs) {
  const at::Tensor h = rms_norm(x, w.norm_post, eps);
  at::Tensor act = silu_mul(run_linear(w.gate_up, h, pairs).contiguous());
  if (w.has_down_in) {
    const int64_t B = w.down_in.N;
    act = at::mul(run_linear(w.down_in, act.reshape({-1, B}), pairs), 1.0 / std::sqrt(static_cast<double>(B)))
              .view(act.sizes());
  }
  return at::add(x, run_linear(w.down, act, pairs));
}

}  // namespace

class DecoderPlan {
 public:
  // per layer: the 22 tensors and 15 ints of `make_layer`
  DecoderPlan(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t heads,
              int64_t kv_heads, int64_t head_dim, int64_t block_size, double eps, double scale, bool pairs,
              bool prefill_blocks)
      : k_caches_(std::move(k_caches)), v_caches_(std::move(v_caches)), H_(heads), KV_(kv_heads),
        hd_(head_dim), block_size_(block_size), eps_(eps), scale_(scale), pairs_(pairs),
        prefill_blocks_(prefill_blocks) {
    const size_t L = k_caches_.size();
    TORCH_CHECK(L > 0 && v_caches_.size() == L && tensors.size() == L * kLayerTensors &&
                    ints.size() == L * kLayerInts,
                "DecoderPlan: 22 tensors, 15 ints and a k / v cache per layer");
    for (size_t l = 0; l < L; ++l)
      layers_.push_back(make_layer(tensors.data() + l * kLayerTensors, ints.data() + l * kLayerInts, H_, KV_, hd_,
                                   "DecoderPlan"));
  }

  int64_t num_layers() const { return static_cast<int64_t>(k_caches_.size()); }

  // x [T, D] (the embeddings), cos / sin [T, hd] of x's dtype → the hidden states after the last
  // layer; the attention arguments as `paged_attention` takes them. out_rows [N] (int64 row
  // indices): return only those rows, [N, D]; the last layer then runs its o projection and MLP
  // on them alone (every row still writes its keys / values). The kernels compute each row by
  // the same operations whatever the other rows, so those rows are bitwise the full result's.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const std::vector<int64_t>& q_lens, const std::vector<int64_t>& seq_lens,
                     const c10::optional<at::Tensor>& out_rows) const {
    TORCH_CHECK(x.dim() == 2, "DecoderPlan.forward: x must be [T, D]");
    const int64_t T = x.size(0);
    if (out_rows.has_value())
      TORCH_CHECK(out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong,
                  "DecoderPlan.forward: out_rows must be a 1-D int64 tensor of row indices");
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const at::Tensor h = rms_norm(x.contiguous(), w.norm_in, eps_);
      const at::Tensor qkv = run_linear(w.qkv, h, pairs_).view({T, H_ + 2 * KV_, hd_});
      const at::Tensor qk = rope(qkv.narrow(1, 0, H_ + KV_), cos, sin);
      at::Tensor a = paged_attention(qk.narrow(1, 0, H_), qk.narrow(1, H_, KV_), qkv.narrow(1, H_ + KV_, KV_),
                                     k_caches_[l], v_caches_[l], slot_mapping, block_tables, q_lens,
                                     seq_lens, block_size_, scale_, pairs_, prefill_blocks_)
                         .reshape({T, H_ * hd_});
      if (out_rows.has_value() && l + 1 == layers_.size()) {
        x = x.index_select(0, *out_rows);
        a = a.index_select(0, *out_rows);
      }
      x = at::add(x, run_linear(w.o, a, pairs_));
      x = mlp_residual(w, x, eps_, pairs_);
    }
    return x;
  }

 private:
  std::vector<LayerWeights> layers_;
  std::vector<at::Tensor> k_caches_, v_caches_;
  int64_t H_, KV_, hd_, block_size_;
  double eps_, scale_;
  bool pairs_, prefill_blocks_;
};

// ---- an MTP draft step in one call ------------------------------------------------------------
//
// `model_zoo/mtp.py`'s MTPModule.forward + draft_logits, the calls its modules make in order:
// x = eh_proj(cat(rms_norm(emb, enorm), rms_norm(h, hnorm))); one decoder layer whose window-1
// attention returns each token's own value vector repeated over its KV group's query heads (q, k
// and their rotation do not reach the output, so they are not rotated); rms_norm(x, norm); the
// draft-vocabulary head. Same kernels, same operands: bitwise the modules' result.
class MTPPlan {
 public:
  // tensors: enorm, hnorm, eh_proj (a, b, c, bias), the layer's 22, norm, head (a, b, c, bias)
  // (33); ints: eh_proj's (kind, N, group), the layer's 15, the head's 3 (21)
  MTPPlan(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t heads,
          int64_t kv_heads, int64_t head_dim, double eps, bool pairs)
      : H_(heads), KV_(kv_heads), hd_(head_dim), eps_(eps), pairs_(pairs) {
    TORCH_CHECK(tensors.size() == 33 && ints.size() == 21, "MTPPlan: 33 tensors and 21 ints");
    TORCH_CHECK(KV_ > 0 && H_ % KV_ == 0, "MTPPlan: heads must be a multiple of kv_heads");
    enorm_ = tensors[0];
    hnorm_ = tensors[1];
    eh_ = make_linear(tensors.data() + 2, ints.data(), "MTPPlan");
    layer_ = make_layer(tensors.data() + 6, ints.data() + 3, H_, KV_, hd_, "MTPPlan");
    norm_ = tensors[28];
    head_ = make_linear(tensors.data() + 29, ints.data() + 18, "MTPPlan");
  }

  // h [A, D] (the base's or the previous depth's pre-norm hidden), emb [A, D] (the embeddings of
  // the tokens those hidden states produced) → (the MTP's pre-norm hidden [A, D], draft logits [A, Vd])
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& h, const at::Tensor& emb) const {
    TORCH_CHECK(h.dim() == 2 && emb.sizes() == h.sizes() && emb.scalar_type() == h.scalar_type(),
                "MTPPlan.forward: h and emb must be [A, D] of one dtype");
    const int64_t T = h.size(0);
    at::Tensor x = run_linear(eh_, at::cat({rms_norm(emb.contiguous(), enorm_, eps_),
                                            rms_norm(h.contiguous(), hnorm_, eps_)}, -1), pairs_);
    const at::Tensor n = rms_norm(x.contiguous(), layer_.norm_in, eps_);
    const at::Tensor qkv = run_linear(layer_.qkv, n, pairs_).view({T, H_ + 2 * KV_, hd_});
    const at::Tensor a = qkv.narrow(1, H_ + KV_, KV_).repeat_interleave(H_ / KV_, 1);
    x = at::add(x, run_linear(layer_.o, a.reshape({T, H_ * hd_}), pairs_));
    x = mlp_residual(layer_, x, eps_, pairs_);
    at::Tensor logits = run_linear(head_, rms_norm(x.contiguous(), norm_, eps_), pairs_);
    return {x, logits};
  }

 private:
  at::Tensor enorm_, hnorm_, norm_;
  LinearSpec eh_, head_;
  LayerWeights layer_;
  int64_t H_, KV_, hd_;
  double eps_;
  bool pairs_;
};

static qs_bind::Register bind_plans([](pybind11::module_& m) {
  py::class_<DecoderPlan>(m, "DecoderPlan")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool>())
      .def("num_layers", &DecoderPlan::num_layers)
      .def("forward", &DecoderPlan::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<MTPPlan>(m, "MTPPlan")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t, double,
                    bool>())
      .def("forward", &MTPPlan::forward, py::call_guard<py::gil_scoped_release>());
});
