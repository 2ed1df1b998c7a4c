"""docs/engines.md from the verdicts the conformance suite has checked against the engines."""

from quantspec.quant.engines import ENGINE_NAMES, ENGINE_VERSIONS, ENGINES

from .conftest import ARTIFACTS

HEAD = """# Engines

What each engine does with each artifact type `quantspec quantize` writes, as the conformance
suite (`tests/conformance`) computes it: vLLM's and SGLang's own compressed-tensors decision code,
lifted from their pinned wheels ({versions}), picks a scheme per layer and loads the tensors through
its own parameter loaders; transformers loads and runs the artifact; compressed-tensors' own
decompression is compared with quantspec's `dequantize`. `quantspec inspect` prints the same verdicts
(`quant.engines.engine_verdicts`); `quantize --target` refuses, before any work, options an engine of
the target would refuse or ignore. Generated: `QUANTSPEC_WRITE_ENGINE_TABLE=1 pytest tests/conformance`.
Capability 9.0 (Hopper) for the FP8 choice; below 8.9 both engines run FP8 weights weight-only.

"""

TAIL = """
The `legacy_*` rows are the layout quantspec wrote before (W8A16 as `int-quantized`; mixed group
sizes and a8w8 fallbacks named shard by shard), kept as cases for `inspect` on old artifacts.

## Artifacts

compressed-tensors is the format; by default (`--target portable`) quantspec writes what vLLM and
SGLang both load with the intended scheme: W8A16 (weight_only_int8 and the a8w8 fallback) as 8-bit
`pack-quantized`, one class-target group at the group size the fused layers use with only other
layers named, whole fused units as one regex that also names the fused layer, and per-tensor FP8
KV-cache scales. Two options stay quantspec-only and need `--target quantspec`: float zero points
(`--zp-dtype`, which reproduce GGUF Q4_1 grids exactly; no engine or compressed-tensors release reads
them) and int8 KV-cache scales (no engine consumes a static int8 KV cache). Static int8 activations
(a8w8) load in vLLM but not in SGLang, whose static int8 layer holds one `input_scale` for all fused
shards: a8w8 needs `--target vllm` (or `quantspec`). transformers runs every artifact without its
KV-cache scales, and refuses asymmetric (packed zero-point) and float zero-point ones.
"""


def render(verdicts: dict) -> str:
    versions = ", ".join(f"{ENGINE_NAMES[e]} {v}" for e, v in ENGINE_VERSIONS.items() if e in ("vllm", "sglang"))
    lines = [HEAD.format(versions=versions),
             "| artifact | quantize options | " + " | ".join(ENGINE_NAMES[e] for e in ENGINES) + " |",
             "|---" * (len(ENGINES) + 2) + "|"]
    for name, per in verdicts.items():
        opts = ARTIFACTS.get(name)
        shown = "(earlier layout)" if opts is None else " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in opts.items()
            if k not in ("smoothquant_alpha", "fallback_layers"))
        cells = [per[e].line() + (f" (KV: {per[e].kv_cache})" if per[e].kv_cache else "") for e in ENGINES]
        lines.append(f"| {name} | {shown} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n" + TAIL
