"""Run an engine's own fused-MoE decision code, lifted from its wheel, on artifacts' configs.

Run as a program in a fresh interpreter (one per engine, as `lift.py`):

    python lift_moe.py ENGINE SOURCE_DIR CT_DIR REQUEST.json  →  JSON on stdout

REQUEST.json: {"capability": 90, "packed_modules_mapping": the engine's Qwen3-MoE class's,
"artifacts": {name: {"quantization_config": ..., "layers": [fused-MoE layer names], "ckpt_names":
[the checkpoint's gate, up, down names]}}}. For each layer the engine's `CompressedTensorsConfig.get_quant_method`
runs unchanged on a layer object of the engine's fused-MoE class: vLLM's
`CompressedTensorsMoEMethod.get_moe_method` (the schemes of expert 0's gate / up / down
projections, resolved by the engine's own target matching, and the method they select), SGLang's
`get_moe_scheme` and the MoE scheme classes' constructors (all of SGLang's compressed-tensors
scheme modules are its own code), and vLLM's FP8 and int8 MoE method constructors (their checks
of the weights' and inputs' strategies). What is not the engines' code: the GPU-kernel oracles
those constructors call last (`select_fp8_moe_backend`, `select_int8_moe_backend`) return no
backend, and vLLM's other MoE method classes are stubs named as the engine's (the WNA16 one's
constructor asks its oracle for Marlin, which takes channel and group scales alike on a GPU of
capability 8.0 and up), so for those the answer is the class vLLM's decision code selects; the
layer object (an `nn.Module` subclassing the engine's
stubbed `RoutedExperts` / `FusedMoE`, with the checkpoint's projection names as vLLM's model
files give them, e.g. Mixtral's w1 / w3 / w2) is built here.
The answer per layer: the selected class's name, or the error the engine's code raised.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lift  # noqa: E402 — the stub machinery of the compressed-tensors lift

_MOE = lift._CT["vllm"] + "compressed_tensors_moe"
lift.REAL["vllm"] += [_MOE, _MOE + ".compressed_tensors_moe", _MOE + ".compressed_tensors_moe_w8a8_fp8",
                      _MOE + ".compressed_tensors_moe_w8a8_int8"]
# the GPU-kernel oracles those two constructors call last, after their checks
_ORACLES = {"vllm.model_executor.layers.fused_moe.oracle.fp8": {"select_fp8_moe_backend": lambda **k: (None, None)},
            "vllm.model_executor.layers.fused_moe.oracle.int8": {"select_int8_moe_backend": lambda **k: (None, None)}}
_overrides = lift._overrides
lift._overrides = lambda engine, capability: {**_overrides(engine, capability), **_ORACLES}
MOE_CLASS = {"vllm": ("vllm.model_executor.layers.fused_moe", "RoutedExperts"),
             "sglang": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE")}


def _moe_layer(engine: str, names: list[str]):
    import importlib

    import torch

    mod, name = MOE_CLASS[engine]
    base = getattr(importlib.import_module(mod), name)
    layer = type(name, (torch.nn.Module, base), {})()
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = names
    layer.moe_config = lift.Stub()  # read by the method constructors only
    return layer


def run(engine: str, request: dict) -> dict:
    import importlib

    ctmod = importlib.import_module(lift._CT[engine] + "compressed_tensors")
    out = {}
    for name, art in request["artifacts"].items():
        res = out[name] = {}
        cfg = ctmod.CompressedTensorsConfig.from_config(json.loads(json.dumps(art["quantization_config"])))
        cfg.packed_modules_mapping = request["packed_modules_mapping"]
        for lname in art["layers"]:
            layer = _moe_layer(engine, art.get("ckpt_names", ["gate_proj", "up_proj", "down_proj"]))
            try:
                method = cfg.get_quant_method(layer, lname)
                chosen = getattr(layer, "scheme", None) if engine == "sglang" else method
                res[lname] = {"method": None if chosen is None else type(chosen).__name__, "error": None}
            except Exception as e:  # noqa: BLE001 — the engine's code refusing is the answer
                where = traceback.extract_tb(e.__traceback__)[-1].name
                res[lname] = {"method": None, "error": f"{type(e).__name__} at {where}: {str(e)[:200]}"}
    return out


def main() -> None:
    engine, source, ct_dir, request = sys.argv[1:5]
    sys.path.insert(0, ct_dir)
    import compressed_tensors  # noqa: F401 — the engine's pinned release, before anything else
    import torch  # noqa: F401
    import transformers  # noqa: F401

    req = json.load(open(request))
    lift.install(engine, source, int(req.get("capability", 90)))
    try:
        out = {"result": run(engine, req), "stubbed": sorted(set(lift.STUBBED))}
    except Exception:  # noqa: BLE001
        out = {"fatal": traceback.format_exc()}
    json.dump(out, sys.stdout, default=repr)


if __name__ == "__main__":
    main()
