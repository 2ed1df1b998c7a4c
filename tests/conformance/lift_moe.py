"""Run an engine's own fused-MoE decision code, lifted from its wheel, on artifacts' configs.

Run as a program in a fresh interpreter (one per engine, as `lift.py`):

    python lift_moe.py ENGINE SOURCE_DIR CT_DIR REQUEST.json  →  JSON on stdout

REQUEST.json: {"capability": 90, "packed_modules_mapping": the engine's Qwen3-MoE class's,
"artifacts": {name: {"quantization_config": ..., "layers": [fused-MoE layer names], "ckpt_names":
[the checkpoint's gate, up, down names], optionally "experts": {"num_experts", "hidden",
"intermediate"}}}}. For each layer the engine's `CompressedTensorsConfig.get_quant_method`
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
files give them, e.g. Mixtral's w1 / w3 / w2, and the `moe_config` of a gated MLP: two w13
shards) is built here.

int4 experts with 8-bit inputs (W4A8, W4AFP8) run vLLM's `CompressedTensorsW4A8Fp8MoEMethod` and
`CompressedTensorsW4A8Int8MoEMethod` (constructors and `create_weights`) and the backend selection they
call (`select_w4a8_moe_backend`, `select_w4a8_int8_moe_backend`: the engine's oracle files, compiled
on first call, `_oracle_function`), and SGLang's `CompressedTensorsW4AFP8MoE`. What is not the
engines' code: the experts kernels' `is_supported_config`, answered by `_w4a8_experts_oracle`
(CUTLASS W4A8 experts on compute capability 9.0, Humming's from 7.5: `has_humming`, which vLLM's
wheel requires). SGLang's answer gives the scheme's `get_min_capability`, which its MoE path does
not check.

MXFP4 experts run their methods' own code too: vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod`
(its constructor picks the experts' kernel) and SGLang's `Mxfp4MoEMethod`
(quantization/mxfp4.py). What is not the engines' code: `CutlassExpertsMxfp4._supports_current_device`
is answered by `_cutlass_mxfp4_oracle` (its C++ `mxfp4_experts_quant_supported`:
csrc/quantization/fp4/mxfp4_experts_quant.cu, `mxfp4_experts_quant_sm_supported`, capability
100 ≤ c < 120 in a CUDA ≥ 12.9 build, which vLLM's cu13 wheels are), and vLLM's base
`FusedMoEMethodBase` is a stand-in that keeps `moe` as the base's `__init__` does (its
constructors read it). Where the request gives an artifact's "experts", the method's `create_weights` runs
on the layer and the answer lists the parameters it made.

The answer per layer: the selected class's name (SGLang: its scheme's, or the method's where it
bypasses schemes, as for MXFP4), vLLM's experts kernel class where the method picks one
(`experts`), SGLang's scheme's `min_capability`, the parameters `create_weights` made (`params`:
name → [shape, dtype]), or the error the engine's code raised.
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
                      _MOE + ".compressed_tensors_moe_w8a8_int8", _MOE + ".compressed_tensors_moe_w4a4_mxfp4",
                      _MOE + ".compressed_tensors_moe_w4a8_fp8", _MOE + ".compressed_tensors_moe_w4a8_int8"]
lift.REAL["sglang"] += ["sglang.srt.layers.quantization.mxfp4"]
# the GPU-kernel oracles those two constructors call last, after their checks
_ORACLES = {"vllm.model_executor.layers.fused_moe.oracle.fp8": {"select_fp8_moe_backend": lambda **k: (None, None)},
            "vllm.model_executor.layers.fused_moe.oracle.int8": {"select_int8_moe_backend": lambda **k: (None, None)}}


def _cutlass_mxfp4_oracle(capability: int) -> dict:
    """vLLM's `CutlassExpertsMxfp4` (fused_moe/experts/cutlass_moe.py) as far as the MXFP4 MoE
    method's constructor asks it: whether the GPU runs its W4A4 experts (module docstring)."""
    class CutlassExpertsMxfp4:
        @staticmethod
        def _supports_current_device() -> bool:
            return 100 <= capability < 120
    return {"vllm.model_executor.layers.fused_moe.experts.cutlass_moe": {"CutlassExpertsMxfp4": CutlassExpertsMxfp4}}


_SOURCE: list[str] = []  # the engine's source root (`main`)
_FUSED_MOE = "vllm.model_executor.layers.fused_moe."


def _oracle_function(module: str, name: str):
    """Function `name` of the engine's file for `module`, compiled from that file on first call (its
    imports then resolve through the lift's finder: stubs, and the overrides below), where
    importing the module itself would make its package `fused_moe` an empty parent of it."""
    def call(*a, **k):
        path = os.path.join(_SOURCE[0], *module.split(".")) + ".py"
        ns = {"__name__": module}
        exec(compile(open(path).read(), path, "exec"), ns)  # noqa: S102 — the engine's own file
        return ns[name](*a, **k)
    return call


def _w4a8_experts_oracle(capability: int) -> dict:
    """vLLM's W4A8 experts kernels as `select_w4a8_moe_backend` asks them (`is_supported_config`,
    modular_kernel.py): `CutlassExpertsW4A8Fp8` runs on compute capability 9.0 exactly
    (`_supports_current_device`: `is_device_capability(90)`), Humming's experts from 7.5
    (`has_humming()` and `has_device_capability((7, 5))`); both take int4 weights with dynamic
    per-token FP8 inputs, the keys the method asks with; a Batched kernel takes the batched
    activation format only (a layer without expert parallelism asks for the standard one)."""
    def kernel(name: str, ok: bool) -> type:
        def is_supported_config(cls, config, weight_key, activation_key, activation_format):
            if ("Batched" in name) != ("Batched" in activation_format.__qualname__):
                return False, "kernel does not support this activation format"
            return (True, None) if ok else (False, f"kernel does not support compute capability {capability}")
        return type(name, (), {"is_supported_config": staticmethod(is_supported_config)})
    humming = {n: kernel(n, capability >= 75)
               for n in ("BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts")}
    return {_FUSED_MOE + "experts.cutlass_moe": {"CutlassExpertsW4A8Fp8": kernel("CutlassExpertsW4A8Fp8", capability == 90)},
            _FUSED_MOE + "experts.fused_humming_moe": humming,
            _FUSED_MOE + "oracle.w4a8": {n: _oracle_function(_FUSED_MOE + "oracle.w4a8", n) for n in
                                         ("select_w4a8_moe_backend",)},
            _FUSED_MOE + "oracle.w4a8_int8": {"select_w4a8_int8_moe_backend": _oracle_function(
                _FUSED_MOE + "oracle.w4a8_int8", "select_w4a8_int8_moe_backend")}}


class _FusedMoEMethodBase(lift.Stub):
    """vLLM's `FusedMoEMethodBase` as far as the MoE methods' constructors use it: `__init__` keeps `moe`."""

    def __init__(self, moe=None, *a, **k):
        self.moe = moe


def _merged(*dicts: dict) -> dict:
    """Override tables merged module by module."""
    out: dict = {}
    for d in dicts:
        for module, attrs in d.items():
            out[module] = {**out.get(module, {}), **attrs}
    return out


_overrides = lift._overrides
lift._overrides = lambda engine, capability: _merged(_overrides(engine, capability), _ORACLES,
                                                     _cutlass_mxfp4_oracle(capability), _w4a8_experts_oracle(capability),
                                                     {_FUSED_MOE[:-1]: {"FusedMoEMethodBase": _FusedMoEMethodBase}})
MOE_CLASS = {"vllm": ("vllm.model_executor.layers.fused_moe", "RoutedExperts"),
             "sglang": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE")}


class _GatedMoeConfig(lift.Stub):
    """vLLM's `FusedMoEConfig` of a gated MLP (gate and up in w13), without bias, with the default
    MoE backend ("auto"), as the methods read it; `_moe_layer` gives it the experts' sizes."""

    w13_num_shards = 2
    moe_backend = "auto"
    has_bias = False


def _moe_layer(engine: str, names: list[str], experts: dict | None = None):
    import importlib

    import torch

    mod, name = MOE_CLASS[engine]
    base = getattr(importlib.import_module(mod), name)
    layer = type(name, (torch.nn.Module, base), {})()
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = names
    layer.moe_config = _GatedMoeConfig()  # read by the method constructors and create_weights
    if experts:  # what SGLang's FusedMoE keeps and its MXFP4 method's create_weights reads
        layer.moe_config.hidden_dim = experts["hidden"]
        layer.moe_config.intermediate_size_per_partition = experts["intermediate"]
        layer.num_local_experts, layer.hidden_size = experts["num_experts"], experts["hidden"]
        layer.intermediate_size_per_partition = experts["intermediate"]
    return layer


def _create(engine: str, method, layer, experts: dict) -> dict:
    """The parameters `method.create_weights` makes on `layer` for `experts`: name → [shape, dtype]."""
    import torch

    method.create_weights(layer, num_experts=experts["num_experts"], hidden_size=experts["hidden"],
                          intermediate_size_per_partition=experts["intermediate"], params_dtype=torch.bfloat16)
    return {n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in layer.named_parameters()}


def run(engine: str, request: dict) -> dict:
    import importlib

    ctmod = importlib.import_module(lift._CT[engine] + "compressed_tensors")
    out = {}
    for name, art in request["artifacts"].items():
        res = out[name] = {}
        cfg = ctmod.CompressedTensorsConfig.from_config(json.loads(json.dumps(art["quantization_config"])))
        cfg.packed_modules_mapping = request["packed_modules_mapping"]
        for lname in art["layers"]:
            experts = art.get("experts")
            layer = _moe_layer(engine, art.get("ckpt_names", ["gate_proj", "up_proj", "down_proj"]), experts)
            try:
                method = cfg.get_quant_method(layer, lname)
                scheme = getattr(layer, "scheme", None)
                chosen = method if engine == "vllm" else scheme if scheme is not None else \
                    method if type(method).__name__ == "Mxfp4MoEMethod" else None
                r = res[lname] = {"method": None if chosen is None else type(chosen).__name__, "error": None}
                if chosen is not None and vars(chosen).get("experts_cls") is not None:  # (a stub answers anything)
                    r["experts"] = chosen.experts_cls.__name__
                least = getattr(type(chosen), "get_min_capability", None) if engine == "sglang" else None
                if least is not None and isinstance(least(), int):
                    r["min_capability"] = least()
                if experts and chosen is not None:
                    r["params"] = _create(engine, method, layer, experts)
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
    _SOURCE.append(source)
    lift.install(engine, source, int(req.get("capability", 90)))
    try:
        out = {"result": run(engine, req), "stubbed": sorted(set(lift.STUBBED))}
    except Exception:  # noqa: BLE001
        out = {"fatal": traceback.format_exc()}
    json.dump(out, sys.stdout, default=repr)


if __name__ == "__main__":
    main()
