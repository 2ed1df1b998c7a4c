"""docs/engines.md: the verdicts the conformance suite checks against the engines' own code,
one row per artifact type, rendered by `render` (the suite fails when the file differs)."""

from quantspec.quant.engines import ENGINE_NAMES, ENGINE_VERSIONS, ENGINES

from .conftest import ARTIFACTS, EAGLE3_ARTIFACTS, MEDUSA_ARTIFACT, MTP_ARTIFACT

__all__ = ["render"]

HEAD = """# Engines

What each engine does with each artifact type `quantspec quantize` writes. vLLM's and SGLang's own
compressed-tensors decision code, lifted from their pinned wheels ({versions}), picks a scheme
per layer and loads the tensors through its own parameter loaders (capability 9.0, Hopper, for
the FP8 choice); transformers ({transformers}) loads and runs the artifact; compressed-tensors' own decompression
is compared with quantspec's `dequantize` (`tests/conformance`). The cells are
`quant.engines.engine_verdicts`, which `quantspec inspect` prints (for another GPU with
`--compute-capability`) and `quantize --target` refuses by (for the serving GPU with the same flag); the suite checks every cell against the engines' code, layer by layer. This file is generated:
`QUANTSPEC_WRITE_ENGINE_TABLE=1 python -m pytest tests/conformance -k engine_table`.

"""

TAIL = """
Schemes: `WNA16` weight-only int (Marlin), `W8A16Fp8` weight-only FP8 (FP8 Marlin), `W8A8Int8` / `W8A8Fp8` quantized activations,
`CompressedLinear` compressed-tensors in transformers, `QuantLinear` quantspec's own.
`{mtp}` is an MTP module (`zoo train-mtp`) quantized on its own: no engine's model registry
has its architecture, so only quantspec runs it, and `quantize` refuses every other target.
`{medusa}` is Medusa heads (`zoo train-draft-head --kind medusa`, the Medusa authors' layout)
quantized on their own; unquantized heads get the same verdicts: neither vLLM nor SGLang has a
Medusa drafter (no file of their wheels mentions Medusa), so only quantspec runs them.
`{eagle3}` are an EAGLE-3 head (`zoo train-draft-head --kind eagle3`, the layout both engines load)
quantized on its own. Both build it with the draft's own quantization config, under their own
layer names (vLLM `model.fc`, `model.layers.<L>.self_attn.qkv_proj`, …; SGLang `model.qkv_proj`,
`model.self_attn.o_proj`, …), which the suite reads from their `llama_eagle3.py`; SGLang builds
`fc` as a plain `torch.nn.Linear`, so the default target leaves `fc` float, and a per-layer group
size is written for the engines' names too. A head's static input and KV-cache scales come from its
own table (`calibrate --model HEAD`, measured as it drafts on its base); vLLM's EAGLE-3 loader puts
its `midlayer.self_attn.k_scale` / `v_scale` into the head's attention, SGLang's skips them. SGLang
refuses static int8 (`a8w8`) on its fused layers (qkv_proj, gate_up_proj) in its parameter loader,
whatever the scale's shape or value: an upstream bug on valid compressed-tensors, which vLLM and
transformers load. `a8w8_fp8_block` is FP8_BLOCK (`--weight-block 128`): one FP8 scale per
weight block, shrunk per fused unit to a block that tiles it (32 × 32 for q/k/v here, 64 × 64 for
the rest), inputs quantized per token and group at run time. The rows "(not written by quantspec)"
are valid compressed-tensors layouts that quantspec reads but does not write: W8A16 as
`int-quantized`, mixed int4 group sizes named shard by shard, an a8w8 fallback named shard by
shard as an `int-quantized` weight-only group, 64 × 64 FP8 blocks on every layer, whose k_proj
rows (96) end mid-block: both engines split a fused layer's block scales by whole block rows and
refuse it, and W4A8 as `int-quantized` (below). `weight_only_nvfp4` / `nvfp4` are NVFP4: E2M1 weights with an FP8 scale per group of 16
under one fp32 global scale per tensor (shared by a fused layer's shards, as both engines' fused
layers take one), and for `nvfp4` inputs quantized the same way at run time under calibrated
global scales. The table's GPU is Hopper (9.0), where both engines run `nvfp4`'s weights alone
(FP4 Marlin) and set its input quantization aside; on Blackwell (10.0) both run it as W4A4, which
`quantize --target portable` probes; on Turing (7.5) vLLM still runs NVFP4 and SGLang refuses it.
transformers runs NVFP4 artifacts in bf16 or fp16 (compressed-tensors decompresses NVFP4 weights to
bf16), and quantizes `nvfp4`'s inputs in that dtype where quantspec and vLLM's kernels use fp32.
`weight_only_mxfp4` / `mxfp4` are MXFP4 (OCP microscaling): E2M1 weights with one power-of-two
scale per group of 32, stored as its E8M0 exponent byte, no global scale, and for `mxfp4` inputs
quantized the same way at run time. vLLM runs them with its one MXFP4 scheme
(`CompressedTensorsW4A4Mxfp4`, from compute capability 8.0), which asks its kernel registry for
MXFP4 inputs whatever the checkpoint says: FP4 Marlin below 10.0 runs the weights alone (`mxfp4`'s
input quantization set aside), FlashInfer's W4A4 kernel from 10.0 quantizes the inputs
(`weight_only_mxfp4`'s too); on Turing (7.5) it refuses them. transformers runs them in bf16
(compressed-tensors decompresses MXFP4 weights to bf16 too). SGLang has no MXFP4 Linear scheme,
so `quantize` writes MXFP4 for `--target vllm` (or quantspec) only. MXFP4 experts (Qwen3-MoE,
Mixtral): vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod` runs CUTLASS W4A4 experts on 10.x-11.x
and Marlin experts elsewhere; SGLang's `Mxfp4MoEMethod` makes GPT-OSS's parameters (`w13_weight`),
which take none of the checkpoint's per-expert `weight_packed`, so SGLang refuses them too.
`a8w4_mxfp4` is MXFP4's weights with FP8 inputs quantized per token and group at run time
(compressed-tensors' MXFP4XFP8; groups of 128, 64 where 128 does not divide K). vLLM runs it with
`CompressedTensorsW4A8Mxfp4`, whose FP8 inputs only Humming's kernel takes: from compute capability
8.9 it runs them as written; below, Humming has no FP8 activations and vLLM keeps the checkpoint's
rather than fall back, so the layers fail to load. SGLang refuses it as it refuses MXFP4.
`weight_only_mxfp8` / `mxfp8` are MXFP8: E4M3 weights with MXFP4's power-of-two scale per group of
32 (`mxfp8-quantized`), and for `mxfp8` inputs quantized the same way at run time. vLLM runs them
with `CompressedTensorsW8A8Mxfp8` (from 7.5), whose kernel registry takes FlashInfer's MXFP8 GEMM
from 10.0 on layers at least 128 wide each way (the inputs quantized at run time, a weight-only
checkpoint's too) and FP8 Marlin otherwise (weight-only, `mxfp8`'s input quantization set aside).
SGLang has no MXFP8 scheme; transformers runs them in bf16. quantspec does not judge MXFP8 experts.
`weight_only_mixed` is mixed precision (`--layer-quant-type`): a config group per type, each
naming its Linears as the engines match them (a fused unit as one regex that also names the fused
layer); both engines pick a scheme per layer. `mixed_fp8_dynamic` gives the attention's Linears
FP8 weights and per-token FP8 inputs (llm-compressor's FP8_DYNAMIC) beside int4 MLPs.
`head_int8` / `head_fp8_dynamic` / `head_fp8_weights` / `head_fp8_block` quantize the output head too
(`--layer-quant-type lm_head=TYPE`). Both engines build it as a `ParallelLMHead`, take its scheme
by name only (never by the class target "Linear") and load it through
`VocabParallelEmbedding.weight_loader`, which wants one scale row per vocabulary row: both load
per-channel heads, and neither loads FP8 block scales there (vLLM's loader asserts, SGLang refuses
the scheme), so a block head is `--target quantspec` only.
`embed_int4` / `embed_int8_head_int8` quantize the input embedding
(`--layer-quant-type model.embed_tokens=TYPE`, `--target vllm`). vLLM gives a `VocabParallelEmbedding`
its `CompressedTensorsEmbeddingWNA16Int`, which dequantizes only the rows a step looks up from
`weight_packed` / `weight_scale` (weight-only INT per channel or group, symmetric: it has no zero
point, and any other scheme raises ValueError at `get_quant_method`). SGLang's compressed-tensors
method leaves the embedding float and its Llama loader skips `weight_packed` with a warning, so the
rows would run unloaded; transformers' weight initialization reads `embed_tokens.weight`, which
compressed-tensors' compressed embedding does not have. Both are refused, and so is a tied head
(vLLM would tie it to an embedding with no `weight`): quantspec unties it.
`a8w4` / `a8w4_fp8` are W4A8 / W4AFP8 (compressed-tensors' presets): int4 weights pack-quantized as
weight-only int4's, with int8 / FP8 inputs quantized per token at run time. vLLM gives `a8w4` its
`CompressedTensorsWNA8Int`, which asks its kernel registry for a kernel with the model's float
activations: Machete (Hopper) or Marlin take the layer first and run the weights with float
inputs, before Humming, the one kernel that reads the input quantization the scheme hands the
layer (the suite answers the registry by those kernels' `can_implement` rules). `a8w4_fp8` is
`CompressedTensorsW4A8Fp8` on Hopper only (CUTLASS W4A8), whose constructor takes int4 groups of
128 only, so the conformance model's layers resolved to groups of 64 are refused. SGLang's W4A8
schemes are fused-MoE ones: no Linear scheme takes either. `w4a8_int_quantized` is `a8w4` stored
the way compressed-tensors stores its W4A8 preset by default (`int-quantized`, a code per int8):
vLLM's `CompressedTensorsW4A8Int` takes it, and on CUDA only Humming takes its signed int4 codes,
given no input quantization, so the inputs run float there too.
`weight_only_fp8` / `weight_only_fp8_block` are FP8 weights with float inputs (W8A16 FP8): both
engines pick their `CompressedTensorsW8A16Fp8` (FP8 Marlin) for per-channel scales, which is also
what they run FP8-input artifacts with below compute capability 8.9; SGLang's takes no block scales
and needs Ampere (8.0), vLLM's takes blocks and runs on Turing (7.5) too.
`a8w8_fp8_tensor_kv_fp8` / `a8w8_fp8_tensor_dynamic` / `weight_only_fp8_tensor` have one FP8 weight
scale per Linear (`--weight-strategy tensor`, compressed-tensors' FP8 scheme; the first is
llm-compressor's FP8 KV-cache example, with one unit kept at float inputs). Both engines load a
fused layer's per-shard scales and requantize its shards to the largest of them (W8A8 FP8), or
expand them per channel (W8A16 FP8); quantspec writes one scale for a fused unit's shards, so
either is exact and every engine runs the weights quantspec runs.
`weight_only_int4_rotated` has SpinQuant's R1 and R2 fused into its weights (`--rotate R1,R2`): its
`transform_config` holds fused transforms only, which vLLM validates and runs around nothing, and
every engine computes the rotated model as stored. `weight_only_int4_quip` has QuIP's run-time
transforms (`--quip v,u`): each Linear's weight is stored turned, with a Hadamard block V on its
input and U on its output at run time. vLLM wraps each turned Linear (a fused one by partition) in
its transform method, which loads the ±1 matrices `{{linear}}.v_input.weight` / `.u_output.weight`
through its `SharedWeightParameter`s. SGLang's default model loader passes over those tensors with a
warning and transformers loads none of them: both run the turned weights bare, which computes
another function, so `quantize --quip` writes for `--target vllm` (or quantspec) only.
`weight_only_int4_r4` adds SpinQuant's R4 to R1 and R2 (`--rotate R1,R2,R4`): the same input
transform on each `down_proj` alone, scheme `R4`, its matrix stored as `{{linear}}.R4_input.weight`;
the engines treat it as they treat QuIP's.
"""


# QuantizeConfig field → the `quantspec quantize` flag
FLAGS = {"fallback_layers": "a8w8-fallback-layers", "fallback_threshold": "a8w8-fallback-threshold",
         "layer_quant_types": "layer-quant-type"}


def _flags(opts: dict) -> str:
    out = []
    for k, v in opts.items():
        if k == "symmetric":
            out.append("--sym" if v else "--asym")
        elif isinstance(v, tuple):  # a repeatable flag
            out += [f"--{FLAGS.get(k, k.replace('_', '-'))} '{x}'" for x in v]
        else:
            out.append(f"--{FLAGS.get(k, k.replace('_', '-'))} {v}")
    return " ".join(out)


def _scheme(v) -> str:
    g = f"block {v.block[0]}×{v.block[1]}" if v.block else f"g{v.group_size}" if v.group_size else \
        "tensor" if v.per_tensor else "channel"
    sym = "" if v.symmetric in (True, None) else " asym"
    act = f" + {v.input_activations}" if v.input_activations else ""
    return f"{v.scheme} {v.num_bits}-bit {g}{sym}{act}"


def _cell(verdict) -> str:
    text = verdict.line()
    if verdict.status != "refused":
        picked = sorted({_scheme(v) for v in verdict.layers.values() if v.scheme is not None})
        text += f": {', '.join(picked)}" if picked else ""
    if verdict.kv_cache:
        text += f"; KV {verdict.kv_cache}"
    return text.replace("|", "/")


def render(verdicts: dict) -> str:
    """The markdown of docs/engines.md for {artifact name: engine → EngineVerdict}."""
    versions = ", ".join(f"{ENGINE_NAMES[e]} {ENGINE_VERSIONS[e]}" for e in ("vllm", "sglang"))
    lines = [HEAD.format(versions=versions, transformers=ENGINE_VERSIONS["transformers"]).rstrip("\n"), "",
             "| artifact | quantize options | " + " | ".join(ENGINE_NAMES[e] for e in ENGINES) + " |",
             "|---" * (len(ENGINES) + 2) + "|"]
    for name, per in verdicts.items():
        opts = {**ARTIFACTS, MTP_ARTIFACT[0]: MTP_ARTIFACT[1], MEDUSA_ARTIFACT[0]: MEDUSA_ARTIFACT[1],
                **EAGLE3_ARTIFACTS}.get(name)
        shown = "(not written by quantspec)" if opts is None else _flags(opts)
        lines.append(f"| {name} | {shown} | " + " | ".join(_cell(per[e]) for e in ENGINES) + " |")
    return "\n".join(lines) + "\n" + TAIL.format(mtp=MTP_ARTIFACT[0], medusa=MEDUSA_ARTIFACT[0],
                                                 eagle3=" / ".join(f"`{n}`" for n in EAGLE3_ARTIFACTS).strip("`"))
