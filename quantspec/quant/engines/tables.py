"""The facts the verdicts are computed from: the engines, the releases they describe, the
`quantize --target` names, and the Llama layer layout vLLM and SGLang build (fused layers and the
class of each linear), read from the engines' code at the pinned versions."""

from __future__ import annotations

__all__ = ["ENGINES", "ENGINE_NAMES", "ENGINE_VERSIONS", "TARGETS", "TARGET_ENGINES", "FUSED_LAYERS",
           "LAYER_CLASSES", "FP8_MIN_CAPABILITY", "NVFP4_MIN_CAPABILITY", "NVFP4_W4A4_CAPABILITY",
           "MXFP4_FP8_CAPABILITY", "MXFP4_MIN_CAPABILITY", "MXFP4_W4A4_CAPABILITY", "MXFP4_MOE_W4A4_CAPABILITIES",
           "MXFP8_MIN_CAPABILITY", "MXFP8_W8A8_CAPABILITY", "MXFP8_W8A8_MIN_DIM",
           "SGLANG_FUSED_STATIC_INT8", "HEAD_BLOCK_SCALES", "VLLM_EMBEDDING", "SGLANG_EMBEDDING",
           "TRANSFORMERS_EMBEDDING", "W4A8_FP8_CAPABILITY", "W4A8_INT_MIN_CAPABILITY", "VLLM_W4A8_INT_INPUTS",
           "VLLM_W4A8_INT_QUANTIZED_INPUTS", "SGLANG_W4A8", "W4A8_MOE_GROUP", "W4A8_MOE_ALIGN",
           "W4A8_MOE_MIN_CAPABILITY", "SGLANG_W4A8_MOE_CAPABILITY", "VLLM_W4A8_INT_MOE", "SGLANG_W4A8_MOE_INPUTS",
           "engine_name"]

ENGINES = ("vllm", "sglang", "transformers", "quantspec")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "transformers": "transformers",
                "quantspec": "quantspec"}
# the releases these verdicts describe (tests/conformance fetches exactly these)
ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "transformers": "5.24.0"}
# `quantize --target`: "portable" = what both vLLM and SGLang load with the intended scheme
TARGETS = ("portable",) + ENGINES
TARGET_ENGINES = {"portable": ("vllm", "sglang"), "vllm": ("vllm",), "sglang": ("sglang",),
                  "transformers": ("transformers",), "quantspec": ()}
# engine layer → the checkpoint's Linears it fuses (vLLM's Llama `packed_modules_mapping`)
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the class of each Llama linear in vLLM / SGLang (name matching: "Linear" is in all of them but
# the output head's, whose scheme both take by name only)
LAYER_CLASSES = {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
                 "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear", "lm_head": "ParallelLMHead",
                 "embed_tokens": "VocabParallelEmbedding"}
# the output head's loader (`VocabParallelEmbedding.weight_loader` in both engines) shards every
# parameter with an output dim by vocabulary row and asserts it holds one row per token, which
# an FP8 block scale ([vocab / block, K / block]) does not; SGLang refuses the scheme up front
HEAD_BLOCK_SCALES = ("its output-head loader (VocabParallelEmbedding.weight_loader) takes one scale row per "
                     "vocabulary row, not FP8 block scales")
# a quantized input embedding (`VocabParallelEmbedding`): vLLM's `get_quant_method` gives it
# `CompressedTensorsEmbeddingWNA16Int` (weight-only INT per channel or group, rows looked up from
# `weight_packed` / `weight_scale`, no zero point) and raises ValueError on any other scheme;
# SGLang's leaves it float, and its Llama `load_weights` skips `weight_packed` with a warning
VLLM_EMBEDDING = ("its compressed-tensors embeddings take weight-only INT per channel or group (WNA16), "
                  "pack-quantized and symmetric only")
SGLANG_EMBEDDING = (f"SGLang {ENGINE_VERSIONS['sglang']} has no quantized embedding (it builds embed_tokens "
                    "float and its loader skips weight_packed with a warning, leaving the rows unloaded)")
TRANSFORMERS_EMBEDDING = (f"transformers {ENGINE_VERSIONS['transformers']}'s weight initialization reads "
                          "embed_tokens.weight, which compressed-tensors' compressed embedding does not have "
                          "(AttributeError)")
# int4 weights with 8-bit inputs quantized per token (W4A8, W4AFP8), pack-quantized: vLLM's
# `CompressedTensorsWNA8Int` takes int8 inputs from 7.5, but asks `choose_mp_linear_kernel` for a
# kernel with the model's float activations, and the CUDA list offers Machete (9.0) and Marlin,
# which run the codes with float inputs, before Humming, the one kernel that reads the layer's
# `_humming_input_quant_config` (an int-quantized checkpoint's `CompressedTensorsW4A8Int` gets
# Humming, the one CUDA kernel that takes signed int4, with no such config);
# `CompressedTensorsW4A8Fp8` (CUTLASS W4A8, else Humming) takes FP8 inputs on compute capability 9.0
# exactly (`_is_fp8_w4a8_sm90`). SGLang has no such Linear scheme (its W4A8 schemes are fused-MoE
# ones), so `_get_scheme_from_parts` raises
W4A8_FP8_CAPABILITY = 90
W4A8_INT_MIN_CAPABILITY = 75  # CompressedTensorsWNA8Int.get_min_capability
VLLM_W4A8_INT_INPUTS = ("int8 input quantization (CompressedTensorsWNA8Int asks for a kernel with float "
                        "activations and gets Machete or Marlin, which run the int4 weights with inputs float, "
                        "before Humming, the one kernel that quantizes them)")
VLLM_W4A8_INT_QUANTIZED_INPUTS = ("int8 input quantization (CompressedTensorsW4A8Int asks for a kernel with float "
                                  "activations, and Humming, the one CUDA kernel that takes its signed int4 codes, "
                                  "is given no input quantization: the inputs run float)")
SGLANG_W4A8 = (f"SGLang {ENGINE_VERSIONS['sglang']} runs int4 weights with 8-bit inputs in fused-MoE experts only "
               "(no compressed-tensors Linear scheme takes them)")
# int4 experts with 8-bit inputs per token (W4A8 / W4AFP8 fused-MoE layers). vLLM: FP8 inputs take
# `CompressedTensorsW4A8Fp8MoEMethod`, whose constructor asserts symmetric weights in groups of 128 and
# asks `select_w4a8_moe_backend` for CUTLASS W4A8 experts (9.0) or Humming's (from 7.5, FP8 inputs),
# and whose `create_weights` asserts hidden and intermediate sizes that are multiples of 256 (CUTLASS's
# int4 reorder); int8 inputs take `CompressedTensorsW4A8Int8MoEMethod`, whose one backend runs on CPUs
# (Arm's CPU_INT4), so on a GPU it raises. SGLang: `CompressedTensorsW4AFP8MoE` for int8 and FP8 inputs
# alike (symmetric pack-quantized int4), whose `cutlass_w4a8_moe` quantizes the experts' inputs to FP8
# with one dynamic scale per tensor and runs groups of 128 whatever the checkpoint's; the scheme asks
# for 9.0 (`get_min_capability`), which SGLang's MoE path does not check before its first forward
W4A8_MOE_GROUP = 128
W4A8_MOE_ALIGN = 256
W4A8_MOE_MIN_CAPABILITY = 75
SGLANG_W4A8_MOE_CAPABILITY = 90
VLLM_W4A8_INT_MOE = (f"vLLM {ENGINE_VERSIONS['vllm']} runs int4 experts with int8 inputs on CPUs only "
                     "(CompressedTensorsW4A8Int8MoEMethod's one backend is Arm's CPU_INT4)")
SGLANG_W4A8_MOE_INPUTS = ("{what} (CompressedTensorsW4AFP8MoE's CUTLASS kernel quantizes the experts' inputs to "
                          "FP8 with one dynamic scale per tensor)")
FP8_MIN_CAPABILITY = 89  # W8A8 FP8 kernels (Ada / Hopper); below it both run FP8 weight-only (SGLang: no blocks)
# SGLang's FP8 weight-only scheme (CompressedTensorsW8A16Fp8.get_min_capability: Ampere); vLLM's runs below it too
SGLANG_W8A16_FP8_MIN_CAPABILITY = 80
# NVFP4: FP4 tensor cores (Blackwell) run W4A4; below, both engines serve an NVFP4 checkpoint weight-only
# (FP4 Marlin: vLLM's `init_nvfp4_linear_kernel`, SGLang's CompressedTensorsW4A16Fp4), its
# input quantization ignored; vLLM's scheme asks for 7.5, SGLang's weight-only one for 8.0
NVFP4_W4A4_CAPABILITY = 100
NVFP4_MIN_CAPABILITY = {"vllm": 75, "sglang": 80}
# MXFP4 (vLLM only: SGLang has no MXFP4 Linear scheme): `CompressedTensorsW4A4Mxfp4` asks for 8.0
# and always requests MXFP4 inputs from `init_mxfp4_linear_kernel`, whose CUDA registry takes
# FlashInfer's W4A4 kernel from 10.0 (inputs quantized at run time, whatever the checkpoint says)
# and FP4 Marlin (weight-only, inputs float) below; its MoE method runs CUTLASS W4A4 on 10.x-11.x
# (`mxfp4_experts_quant_supported`) and Marlin experts (weight-only) elsewhere
MXFP4_MIN_CAPABILITY = 80
MXFP4_W4A4_CAPABILITY = 100
MXFP4_MOE_W4A4_CAPABILITIES = range(100, 120)
# MXFP4 weights with FP8 inputs per token or group (MXFP4XFP8): vLLM's `CompressedTensorsW4A8Mxfp4`
# (8.0, as W4A4Mxfp4) asks the registry for a kernel that takes FP8 inputs, and of the CUDA ones only
# Humming does (vLLM's wheel requires humming-kernels); Humming runs FP8 activations from 8.9 (its
# support matrix), and vLLM keeps a checkpoint's FP8 inputs rather than fall back
# (`allow_input_schema_fallback`), so below 8.9 the layer fails when its weights are processed
MXFP4_FP8_CAPABILITY = 89
# MXFP8 (vLLM only: SGLang has no MXFP8 scheme): `CompressedTensorsW8A8Mxfp8` asks for 7.5 and
# `init_mxfp8_linear_kernel`'s CUDA registry takes FlashInfer's MXFP8 GEMMs from 10.0 (inputs
# quantized to MXFP8 at run time, whatever the checkpoint says) where the layer is at least
# `MXFP8_W8A8_MIN_DIM` wide each way (`_check_mm_mxfp8_shape`; on 12.x also N a multiple of 32),
# and FP8 Marlin (weight-only, inputs float) otherwise
MXFP8_MIN_CAPABILITY = 75
MXFP8_W8A8_CAPABILITY = 100
MXFP8_W8A8_MIN_DIM = 128
# SGLang's static int8 scheme on a fused layer: `CompressedTensorsW8A8Int8.create_weights` makes one
# input_scale element, and `PerTensorScaleParameter._load_into_shard_id` (srt/layers/parameter.py)
# writes shard q/k/v (gate/up) at index 0/1/2 (0/1): whatever the scale's shape or value
SGLANG_FUSED_STATIC_INT8 = (f"SGLang {ENGINE_VERSIONS['sglang']}'s CompressedTensorsW8A8Int8.create_weights "
                            "gives a fused layer one input_scale element and "
                            "PerTensorScaleParameter._load_into_shard_id indexes it by shard, so the "
                            "k/v and up shards' input_scale raise IndexError")


def engine_name(engine: str) -> str:
    """The engine's name as written ("vllm" → "vLLM")."""
    return ENGINE_NAMES[engine]


DEFAULT_CAPABILITY = 90  # the GPU verdicts assume unless told (Hopper)


def parse_capability(value) -> int:
    """A GPU's compute capability as `--compute-capability` takes it ("8.0", 8.9, "10.0"; None: Hopper's
    9.0) → the engines' integer form (80, 89, 100)."""
    from quantspec.errors import QuantSpecError

    if value is None:
        return DEFAULT_CAPABILITY
    try:
        major, _, minor = str(value).strip().partition(".")
        cap = int(major) * 10 + int(minor or 0)
        ok = len(minor) <= 1 and 70 <= cap < 130
    except ValueError:
        ok = False
    if not ok:
        raise QuantSpecError(f"--compute-capability {value!r}: give the GPU's compute capability as MAJOR.MINOR, e.g. "
                             "7.5 (T4), 8.0 (A100), 8.9 (L40S), 9.0 (H100), 10.0 (B200)")
    return cap
