"""Run an engine's own compressed-tensors decision code, lifted from its wheel, on artifacts.

Run as a program in a fresh interpreter (one per engine, so the engine's modules and its pinned
compressed-tensors never meet quantspec's):

    python lift.py ENGINE SOURCE_DIR CT_DIR REQUEST.json  →  JSON on stdout

SOURCE_DIR holds the `.py` files of the engine's wheel, CT_DIR the compressed-tensors release
the engine pins. The modules in `REAL[engine]` — config parsing, target matching (incl. fused
layers), scheme selection, the scheme classes (their constructors and `create_weights`), the
parameter classes (their shard loaders), KV-cache scheme handling — are imported from SOURCE_DIR
and run unchanged. Every other module of the engine's package is a stub (`Stub`: importable,
subclassable, callable, attribute access gives more stubs), and so is any third-party module
those files import that is not installed (CUDA kernels, ...). `OVERRIDES` gives the few stubs
whose values the decisions read: the platform (a GPU of compute capability `capability`), tensor
parallelism (rank 0 of 1) and loggers. vLLM's transform selection (`transform.linear`: which
Linears it runs a `transform_config`'s transforms around) is its own code too, and each Linear's
answer says which transforms it wrapped around the method (`transforms`).

What is not the engines' code, and so stated here: vLLM's NVFP4 and MXFP4 kernel registries are
answered by `_nvfp4_kernel_oracle` (the rule its registry applies on a GPU without FlashInfer) and
`_mxfp4_kernel_oracle` and `_mxfp8_kernel_oracle` (the rules it applies with FlashInfer's kernels
usable: vLLM's wheel requires flashinfer-python, nvidia-cutlass-dsl and ninja; without them it
takes Marlin on Blackwell too; the MXFP4 one also with Humming's, for FP8 inputs, and the dynamic
FP8 key it is asked for is `_Fp8Key`), and its mixed-precision registry, where a scheme asks it (the W4A8 ones), by `_mp_kernel_oracle`
(the `can_implement` rules of the CUDA kernels it tries first); the driver below builds one layer object per
engine layer (an `nn.Module` of the engine's class name, subclassing the stubbed `LinearBase` /
`Attention` / `RadixAttention`) and calls the engine's entry points on it —
`get_quant_method(layer, prefix)`, `scheme.create_weights(...)` — then loads each checkpoint
shard's tensors through the created parameters' own `load_qkv_weight` /
`load_merged_column_weight` / `load_row_parallel_weight` with the shard ids and offsets a fused
linear passes them (q/k/v; 0/1 with the running offset; for an FP8 block scale both counted in
block rows, rounded up, as the engines' fused linears count them), and an output head's
(`ParallelLMHead`, over its padded vocabulary) and an input embedding's (`VocabParallelEmbedding`,
with the parameters its quant method creates as the layer's `__init__` asks) through the engine's
own `VocabParallelEmbedding.weight_loader`, compiled from its file; an embedding's rows
`embedding_ids` are then looked up by the engine's own method (vLLM's Triton kernel, in Triton's
interpreter) and returned as `rows`. The answer gives, per layer, the loaded
values of the scale parameters the request names (`value_leaves`), so the caller can compare them
with the artifact's tensors, and whether the config group the engine resolved for it quantizes
its inputs (`inputs`, from the engine's own `get_scheme_dict`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import traceback
import types

logging.disable(logging.WARNING)

P = {"vllm": "vllm.model_executor.layers.quantization.",
     "sglang": "sglang.srt.layers.quantization."}
_CT = {e: p + "compressed_tensors." for e, p in P.items()}
REAL = {
    "vllm": [_CT["vllm"] + m for m in (
        "compressed_tensors", "utils", "schemes", "schemes.compressed_tensors_scheme",
        "schemes.compressed_tensors_w4a4_mxfp4", "schemes.compressed_tensors_w4a4_nvfp4",
        "schemes.compressed_tensors_w4a8_fp8", "schemes.compressed_tensors_w4a8_int",
        "schemes.compressed_tensors_w4a8_mxfp4", "schemes.compressed_tensors_w8a8_fp8",
        "schemes.compressed_tensors_w8a8_int8", "schemes.compressed_tensors_w8a8_mxfp8",
        "schemes.compressed_tensors_w8a16_fp8", "schemes.compressed_tensors_wNa4",
        "schemes.compressed_tensors_wNa8", "schemes.compressed_tensors_wNa8o8",
        "schemes.compressed_tensors_wNa16", "compressed_tensors_embedding", "transform.linear",
        "transform.module", "transform.utils")]
    + [P["vllm"] + m for m in ("base_config", "utils.config_utils", "utils.marlin_utils", "utils.mxfp8_utils",
                               "utils.fp8_utils")]
    + ["vllm.scalar_type", "vllm.model_executor.parameter"],
    "sglang": [_CT["sglang"] + m for m in ("compressed_tensors", "utils", "schemes")]
    + [P["sglang"] + m for m in ("base_config", "marlin_utils", "utils", "fp8_utils")]
    + ["sglang.srt.layers.parameter"],
}
# SGLang's schemes package imports every scheme module: all of them are its own code
SCHEME_PACKAGE = {"vllm": None, "sglang": _CT["sglang"] + "schemes"}
# the engines' layer classes the decisions look at (isinstance checks), by module
VOCAB = {"vllm": "vllm.model_executor.layers.vocab_parallel_embedding",
         "sglang": "sglang.srt.layers.vocab_parallel_embedding"}
LAYER_BASES = {
    "vllm": {"linear": ("vllm.model_executor.layers.linear", "LinearBase"),
             "attention": ("vllm.model_executor.layers.attention", "Attention"),
             "lm_head": (VOCAB["vllm"], "ParallelLMHead"),
             "embedding": (VOCAB["vllm"], "VocabParallelEmbedding")},
    "sglang": {"linear": ("sglang.srt.layers.linear", "LinearBase"),
               "attention": ("sglang.srt.layers.radix_attention", "RadixAttention"),
               "lm_head": (VOCAB["sglang"], "ParallelLMHead"),
               "embedding": (VOCAB["sglang"], "VocabParallelEmbedding")},
}
PARAMETERS = {"vllm": "vllm.model_executor.parameter", "sglang": "sglang.srt.layers.parameter"}
VOCAB_CODE: dict = {}  # engine → its `_vocab_code`, once installed
VOCAB_CLASSES = {"ParallelLMHead": "lm_head", "VocabParallelEmbedding": "embedding"}  # loaded by vocabulary row


# ---- stubs -----------------------------------------------------------------------------------------

class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())


class Stub(metaclass=_StubMeta):
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


def _stub_class(name: str) -> type:
    return _StubMeta(name.rsplit(".", 1)[-1], (Stub,), {"__qualname__": name, "__module__": "stub"})


class StubModule(types.ModuleType):
    def __init__(self, name: str, attrs: dict | None = None):
        super().__init__(name)
        self.__path__ = []
        self.__file__ = f"<stub {name}>"
        self.__dict__.update(attrs or {})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, attrs=None, empty=False):
        self.attrs, self.empty = attrs, empty

    def create_module(self, spec):
        return None if self.empty else StubModule(spec.name, self.attrs)

    def exec_module(self, module):
        pass


STUBBED: list[str] = []


class EngineFinder(importlib.abc.MetaPathFinder):
    """The engine's package: REAL modules from the wheel's source, their parent packages as empty
    packages (their `__init__` not run), everything else a stub."""

    def __init__(self, root: str, package: str, real: list[str], overrides: dict):
        self.root, self.package, self.real, self.overrides = root, package, set(real), overrides
        self.parents = {".".join(r.split(".")[:i]) for r in real for i in range(1, r.count(".") + 1)}

    def find_spec(self, fullname, path, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        rel = os.path.join(self.root, *fullname.split("."))
        if fullname in self.real:
            if os.path.isdir(rel):
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(rel, "__init__.py"), submodule_search_locations=[rel])
            return importlib.util.spec_from_file_location(fullname, rel + ".py")
        if fullname in self.parents and os.path.isdir(rel):
            spec = importlib.machinery.ModuleSpec(fullname, _Loader(empty=True), is_package=True)
            spec.submodule_search_locations = [rel]
            return spec
        if fullname.startswith(SCHEME_PACKAGE_PREFIX) and os.path.isfile(rel + ".py"):
            return importlib.util.spec_from_file_location(fullname, rel + ".py")
        STUBBED.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Loader(self.overrides.get(fullname)),
                                              is_package=True)


class MissingFinder(importlib.abc.MetaPathFinder):
    """Last resort for imports made by the engine's files: a module that is not installed (CUDA
    kernels, serving dependencies) is a stub. Imports made by anything else fail as usual."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path, target=None):
        f = sys._getframe(1)
        while f is not None:
            fn = f.f_code.co_filename
            if not fn.startswith("<frozen") and "importlib" not in fn:
                break
            f = f.f_back
        if f is None or not f.f_code.co_filename.startswith(self.root):
            return None
        STUBBED.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


SCHEME_PACKAGE_PREFIX = "\0"


def _overrides(engine: str, capability: int) -> dict:
    import triton
    import triton.language  # noqa: F401
    class Capability(tuple):
        def to_int(self):
            return self[0] * 10 + self[1]

    cap = Capability((capability // 10, capability % 10))

    class Platform(Stub):
        def get_device_capability(self, *a, **k):
            return cap

        def has_device_capability(self, c, *a, **k):
            return cap.to_int() >= (c if isinstance(c, int) else c[0] * 10 + c[1])

        def is_xpu(self):
            return False

        def is_cuda(self):
            return True

        def is_rocm(self):
            return False

        def is_cpu(self):
            return False

    def logger(name=None):
        lg = logging.getLogger(name)
        lg.warning_once = lg.warning
        lg.info_once = lg.info
        lg.debug_once = lg.debug
        return lg

    if engine == "vllm":
        return {
            "vllm.model_executor.kernels.linear": {"init_nvfp4_linear_kernel": _nvfp4_kernel_oracle(cap.to_int()),
                                                   "init_mxfp4_linear_kernel": _mxfp4_kernel_oracle(cap.to_int()),
                                                   "init_mxfp8_linear_kernel": _mxfp8_kernel_oracle(cap.to_int()),
                                                   "choose_mp_linear_kernel": _mp_kernel_oracle(cap.to_int()),
                                                   "MPLinearLayerConfig": _MPLinearLayerConfig},
            # the FP8 input key of an MXFP4XFP8 layer, as the MXFP4 oracle reads it (`_Fp8Key`)
            P["vllm"] + "utils.quant_utils": {"create_fp8_quant_key": _Fp8Key},
            "vllm.platforms": {"current_platform": Platform()},
            "vllm.logger": {"init_logger": logger},
            "vllm.distributed": {"get_tensor_model_parallel_rank": lambda: 0,
                                 "get_tensor_model_parallel_world_size": lambda: 1},
            "vllm.distributed.parallel_state": {"get_tensor_model_parallel_rank": lambda: 0,  # transform.module's
                                                "get_tensor_model_parallel_world_size": lambda: 1},
            # the embedding's lookup kernel runs in Triton's interpreter (`main` sets TRITON_INTERPRET)
            "vllm.triton_utils": {"triton": triton, "tl": triton.language},
        }
    return {
        "sglang.srt.utils": {"is_cuda": lambda: True, "is_hip": lambda: False, "is_npu": lambda: False,
                             "is_xpu": lambda: False, "is_cpu": lambda: False,
                             "get_bool_env_var": lambda *a, **k: False,
                             "get_device_capability": lambda *a, **k: tuple(cap),
                             "get_cuda_version": lambda *a, **k: (12, 8)},
        "sglang.srt.runtime_context": {"get_platform": lambda: Platform()},
        "sglang.srt.distributed": {"get_tensor_model_parallel_rank": lambda: 0,
                                   "get_tensor_model_parallel_world_size": lambda: 1},
        "sglang.srt.layers.dp_attention": {"get_attention_tp_rank": lambda: 0,
                                           "get_attention_tp_size": lambda: 1},
        "sglang.srt.layers.quantization.fp8_utils": {"cutlass_fp8_supported": lambda: True},
    }


def _nvfp4_kernel_oracle(capability: int):
    """vLLM's `init_nvfp4_linear_kernel` (kernels/linear/__init__.py) as its CUDA registry
    resolves on a GPU of `capability` without FlashInfer: the FP4-tensor-core kernels
    (`CutlassNvFp4LinearKernel`, `cutlass_fp4_supported`: sm_100) for W4A4, else the first
    weight-only one that runs, FP4 Marlin (`is_fp4_marlin_supported`: sm_75); an object of a
    class of that name (the kernel modules themselves ask FlashInfer and CUDA, so they are not
    lifted)."""
    def init_nvfp4_linear_kernel(use_a16: bool = False):
        name = "CutlassNvFp4LinearKernel" if capability >= 100 and not use_a16 else \
            "MarlinNvFp4LinearKernel" if capability >= 75 else "EmulationNvFp4LinearKernel"
        return type(name, (), {})()
    return init_nvfp4_linear_kernel


class _Fp8Key:
    """vLLM's `create_fp8_quant_key(static, group_shape)` (utils/quant_utils, a stub otherwise): the
    dynamic FP8 input key `CompressedTensorsW4A8Mxfp4` asks the MXFP4 registry for."""

    def __init__(self, static: bool, group_shape=None):
        self.static, self.group_shape = static, group_shape


def _mxfp4_kernel_oracle(capability: int):
    """vLLM's `init_mxfp4_linear_kernel` (kernels/linear/__init__.py, `_POSSIBLE_MXFP4_KERNELS`) as
    its CUDA registry resolves on a GPU of `capability` with FlashInfer's kernels usable: the first
    kernel that runs and implements the requested inputs — FlashInfer's W4A4
    (`FlashInferMxFp4LinearKernel`: sm_100 and up, MXFP4 inputs only, quantized at run time), then
    FP4 Marlin (`MarlinMxFp4LinearKernel`: `is_fp4_marlin_supported`, sm_75; weight-only, a
    requested MXFP4 input quantization ignored); below sm_75 none of the default install's kernels runs
    and the registry raises. FP8 inputs (`_Fp8Key`, MXFP4XFP8) only Humming implements
    (`HummingMxFp4LinearKernel`: sm_75, its `_supports_quant_scheme` takes the key; vLLM's wheel
    requires humming-kernels), and vLLM keeps them (`allow_input_schema_fallback` off for FP8): Humming
    runs FP8 activations from sm_89 (its support matrix), and below it
    `prepare_humming_linear_layer_config` raises once the weights are loaded — which the oracle
    raises here instead as a RuntimeError (not the registry's ValueError, which the scheme would
    catch to fall back to MXFP4 inputs). An object of a class of that name whose `quantizes_inputs`
    says what the kernel does with the inputs (the kernel modules ask FlashInfer, Humming and CUDA,
    so they are not lifted)."""
    def init_mxfp4_linear_kernel(activation_quant_key=None):
        if isinstance(activation_quant_key, _Fp8Key):
            if capability < 89:
                raise RuntimeError(f"No compatible Humming input schema for FP8 inputs on SM{capability} "
                                   "(allow_fallback=False)")
            return type("HummingMxFp4LinearKernel", (), {"quantizes_inputs": True})()
        mxfp4_inputs = getattr(activation_quant_key, "__name__", None) == "kMxfp4Dynamic"
        if capability >= 100 and mxfp4_inputs:
            return type("FlashInferMxFp4LinearKernel", (), {"quantizes_inputs": True})()
        if capability >= 75:
            return type("MarlinMxFp4LinearKernel", (), {"quantizes_inputs": False})()
        raise ValueError("Failed to find a kernel that can implement the MXFP4 linear layer.")
    return init_mxfp4_linear_kernel


def _mxfp8_kernel_oracle(capability: int):
    """vLLM's `init_mxfp8_linear_kernel` (kernels/linear/__init__.py, `_POSSIBLE_MXFP8_KERNELS[CUDA]`)
    as its CUDA registry resolves on a GPU of `capability` with FlashInfer's kernels usable: the first
    kernel whose `is_supported` and `can_implement` pass — FlashInfer's CuTe-DSL MXFP8 GEMM (10.x)
    and its CUTLASS one (10.0 and up), both under `_check_mm_mxfp8_shape` (K ≥ 128, K a multiple of
    32, N ≥ 128; on 12.x the CUTLASS one also asks N a multiple of 32) and both quantizing the
    inputs to MXFP8 at run time; then FP8 Marlin (`is_fp8_marlin_supported`: 7.5; weight-only, K a
    multiple of 32); then the emulation (weights dequantized, inputs float). An object of a class
    of that name whose `quantizes_inputs` says what the kernel does with the inputs (the kernel
    modules ask FlashInfer and CUDA, so they are not lifted)."""
    def init_mxfp8_linear_kernel(*, weight_shape, bmm_batch_size=None):
        N, K = weight_shape
        shape_ok = K >= 128 and K % 32 == 0 and N >= 128
        if 100 <= capability < 110 and shape_ok:
            return type("FlashInferCutedslMxfp8LinearKernel", (), {"quantizes_inputs": True})()
        if capability >= 100 and shape_ok and not (120 <= capability < 130 and N % 32):
            return type("FlashInferCutlassMxfp8LinearKernel", (), {"quantizes_inputs": True})()
        if capability >= 75 and K % 32 == 0:
            return type("MarlinMxfp8LinearKernel", (), {"quantizes_inputs": False})()
        return type("EmulationMxfp8LinearKernel", (), {"quantizes_inputs": False})()
    return init_mxfp8_linear_kernel


def _mp_kernel_oracle(capability: int):
    """vLLM's `choose_mp_linear_kernel` (kernels/linear/__init__.py, `_POSSIBLE_KERNELS[CUDA]`) on a
    GPU of `capability`: the first kernel whose `can_implement` takes the layer's config, by the
    rules of the kernels it tries first — CUTLASS W4A8 (9.0 exactly, FP8 activations, signed int4
    without zero points, groups of 128, K and N multiples of 128, bf16 out), Machete (9.0, 16-bit
    activations, its GPTQ / AWQ types, groups -1 / 64 / 128, K a multiple of 64 and N of 128),
    Marlin (from 7.5, its GPTQ / AWQ types, groups -1 / 32 / 64 / 128; it pads misaligned
    tiles) — else Humming, last in the list (vLLM's wheel requires humming-kernels; Exllama and
    Triton W4A16 between them take 16-bit activations only and are not modelled). A class of
    that name whose `quantizes_inputs` says whether the kernel quantizes the layer's inputs as
    its config group asks: CUTLASS W4A8 does; Humming does for 8-bit activations or where the
    scheme gives the layer `_humming_input_quant_config` (the driver reads it after
    `create_weights`, `None` here); the others run the activations as they come."""
    def choose_mp_linear_kernel(c, compute_capability=None):
        import torch
        from vllm.scalar_type import scalar_types as st

        K, N = c.partition_weight_shape
        g, zp, act = c.group_size, c.zero_points, c.act_type
        half = act in (torch.float16, torch.bfloat16)
        gptq_awq = (st.uint4, st.uint8) if zp else (st.uint4b8, st.uint8b128)
        if capability == 90 and act == torch.float8_e4m3fn and not zp and c.weight_type == st.int4 and g == 128 \
                and K % 128 == 0 and N % 128 == 0 and getattr(c, "out_type", None) == torch.bfloat16:
            name = "CutlassW4A8LinearKernel"
        elif capability == 90 and half and c.weight_type in gptq_awq and g in (-1, 64, 128) \
                and K % 64 == 0 and N % 128 == 0:
            name = "MacheteLinearKernel"
        elif capability >= 75 and c.weight_type in ((st.uint4,) if zp else (st.uint4b8, st.uint8b128)) \
                and g in (-1, 32, 64, 128):
            name = "MarlinLinearKernel"
        else:
            name = "HummingLinearKernel"
        quantizes = True if name == "CutlassW4A8LinearKernel" else \
            (act.itemsize == 1 or None) if name == "HummingLinearKernel" else False
        return type(name, (), {"quantizes_inputs": quantizes, "__init__": lambda self, *a, **k: None})
    return choose_mp_linear_kernel


class _MPLinearLayerConfig(types.SimpleNamespace):
    """vLLM's `MPLinearLayerConfig` (a dataclass of the layer's shapes and types), as the oracle reads it."""


def install(engine: str, source: str, capability: int) -> None:
    global SCHEME_PACKAGE_PREFIX
    import torch

    if SCHEME_PACKAGE[engine]:
        SCHEME_PACKAGE_PREFIX = SCHEME_PACKAGE[engine] + "."
    # sglang asks torch directly for the device's capability
    torch.cuda.get_device_capability = lambda *a, **k: (capability // 10, capability % 10)
    sys.meta_path.insert(0, EngineFinder(source, engine, REAL[engine], _overrides(engine, capability)))
    sys.meta_path.append(MissingFinder(source))


# ---- the driver ------------------------------------------------------------------------------------

def _short(cls_name: str) -> str:
    return cls_name.removeprefix("CompressedTensors")


def _scheme_args(scheme) -> dict:
    d = {}
    own = vars(scheme)  # the scheme's own attributes (its stubbed base class answers anything)
    for k in ("num_bits", "group_size", "symmetric", "strategy", "is_static_input_scheme",
              "input_symmetric", "use_a16", "has_input_global_scale"):
        if k in own:
            v = own[k]
            d[k] = v if isinstance(v, (int, bool, str, type(None))) else str(v)
    if "num_bits" not in d and isinstance(own.get("pack_factor"), int):  # SGLang's WNA16 keeps only this
        d["num_bits"] = 32 // own["pack_factor"]
    wq = own.get("weight_quant")
    if wq is not None:
        d.update(num_bits=wq.num_bits, symmetric=wq.symmetric, strategy=str(getattr(wq.strategy, "value", wq.strategy)))
    if "kernel" in own and not isinstance(own["kernel"], Stub):  # the kernel an oracle answers (`_nvfp4_kernel_oracle`, ...)
        d["kernel"] = type(own["kernel"]).__name__
        if "quantizes_inputs" in vars(type(own["kernel"])):
            d["kernel_quantizes_inputs"] = own["kernel"].quantizes_inputs
    if "strategy" in d and not isinstance(d["strategy"], str):
        d["strategy"] = str(d["strategy"])
    if "A16" in type(scheme).__name__:  # compressed-tensors' name for 16-bit activations: inputs run float
        d.setdefault("kernel_quantizes_inputs", False)
    return d


def _layer(engine: str, kind: str, cls_name: str):
    import torch

    mod, base = LAYER_BASES[engine][kind]
    Base = getattr(importlib.import_module(mod), base)
    cls = type(cls_name, (torch.nn.Module, Base), {})
    layer = cls()
    if engine == "sglang" and kind == "linear":
        layer.tp_group = None  # SGLang's linears keep their group: None is one rank (its fp8_utils reads it)
    if kind == "linear":  # the loader a transform method hands its scheme where the lifted (stubbed)
        layer.weight_loader = None  # WEIGHT_LOADER_V2_SUPPORTED lacks it: None, as the driver passes schemes
    return layer


def _vocab_code(engine: str, source: str) -> dict:
    """The engine's own `pad_vocab_size` (with its `DEFAULT_VOCAB_PADDING_SIZE`) and
    `VocabParallelEmbedding.weight_loader`, the loader every parameter of an output head
    (`ParallelLMHead`) is loaded through, compiled from its wheel's file: the module itself
    imports the engine's distributed runtime, which is not lifted."""
    import ast

    import torch

    path = os.path.join(source, *VOCAB[engine].split(".")) + ".py"
    tree = ast.parse(open(path).read(), path)
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "pad_vocab_size"
            or isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "DEFAULT_VOCAB_PADDING_SIZE"
                                                 for t in n.targets)]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VocabParallelEmbedding")
    keep += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "weight_loader"]
    ns = {"torch": torch, "Parameter": torch.nn.Parameter,
          "UninitializedParameter": torch.nn.parameter.UninitializedParameter,
          "BasevLLMParameter": importlib.import_module(PARAMETERS[engine]).BasevLLMParameter}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), ns)  # noqa: S102 — the engine's code
    return ns


def _head(engine: str, vocab: int, kind: str = "lm_head"):
    """An output head of `vocab` tokens as the engine's `ParallelLMHead` holds it on one rank
    (`kind` "embedding": an input embedding, its `VocabParallelEmbedding`): its padded row count
    and its own weight loader (`_vocab_code`)."""
    code = VOCAB_CODE[engine]
    layer = _layer(engine, kind, LAYER_BASES[engine][kind][1])
    layer.org_vocab_size, layer.tp_size, layer.use_presharded_weights = vocab, 1, False
    layer.shard_indices = types.SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=vocab)
    layer.weight_loader = types.MethodType(code["weight_loader"], layer)
    return layer, code["pad_vocab_size"](vocab)


def _load(engine: str, layer, cls_name: str, shards: list[dict], tensors: dict
          ) -> tuple[list[str], list[str], list[str], list[str]]:
    """Load every shard's tensors through the parameters' own loaders, with the arguments the
    engine's fused linear passes them (SGLang's take `tp_rank` and `use_presharded_weights`);
    → (errors, never loaded, lossy casts: float tensors copied into integer parameters, skipped).
    An error names the engine function that raised it (`IndexError at _load_into_shard_id: ...`).
    A tensor no parameter takes is an error in vLLM (its model's `load_weights` indexes its
    parameters by name) and skipped in SGLang (its default model loader passes over it with a
    warning, as `test_quip.py` runs it)."""
    errors, loaded, casts, skipped = [], set(), [], []
    params = dict(layer.named_parameters())
    rank = {"tp_rank": 0, "use_presharded_weights": False} if engine == "sglang" else {}
    offset = 0
    for i, shard in enumerate(shards):
        sid = "qkv"[i] if cls_name == "QKVParallelLinear" else i
        for leaf, t in tensors.get(shard["name"], {}).items():
            p = params.get(leaf)
            if p is None:
                (skipped if engine == "sglang" else errors).append(f"unexpected tensor {leaf}")
                continue
            at, size = offset, shard["N"]
            if type(p).__name__ == "BlockQuantScaleParameter":  # the fused linear counts in block rows
                bn = layer.weight_block_size[0]
                at, size = -(-at // bn), -(-size // bn)
            try:
                if cls_name in VOCAB_CLASSES:
                    layer.weight_loader(p, t)
                elif cls_name == "QKVParallelLinear":
                    p.load_qkv_weight(loaded_weight=t, num_heads=1, shard_id=sid, shard_offset=at,
                                      shard_size=size, **rank)
                elif cls_name == "MergedColumnParallelLinear":
                    p.load_merged_column_weight(loaded_weight=t, shard_id=sid, shard_offset=at,
                                                shard_size=size, **rank)
                elif rank:  # SGLang's RowParallelLinear: with the rank, else without it
                    try:
                        p.load_row_parallel_weight(t, **rank)
                    except TypeError:
                        p.load_row_parallel_weight(t)
                else:
                    p.load_row_parallel_weight(t)
                loaded.add(leaf)
                if t.is_floating_point() and not p.is_floating_point():
                    casts.append(f"{leaf}: {t.dtype} into {p.dtype}")
            except Exception as e:  # noqa: BLE001 — the engine's loader refusing is the answer
                where = traceback.extract_tb(e.__traceback__)[-1].name
                errors.append(f"{leaf}: {type(e).__name__} at {where}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}")
        offset += shard["N"]
    never = sorted(set(params) - loaded)
    return errors, never, sorted(set(casts)), sorted(set(skipped))


def run(engine: str, request: dict) -> dict:
    import torch

    ctmod = importlib.import_module(_CT[engine] + "compressed_tensors")
    out = {}
    for name, art in request["artifacts"].items():
        res = {"layers": {}, "kv": None, "error": None}
        out[name] = res
        try:
            cfg = ctmod.CompressedTensorsConfig.from_config(json.loads(json.dumps(art["quantization_config"])))
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e}"
            continue
        cfg.packed_modules_mapping = request["packed_modules_mapping"]
        tensors = {k: {leaf: _tensor(t) for leaf, t in v.items()} for k, v in art["tensors"].items()}
        for lname, spec in art["layers"].items():
            r = {"scheme": None, "args": {}, "error": None, "load_errors": [], "never_loaded": [],
                 "casts": [], "skipped": [], "values": {}}
            res["layers"][lname] = r
            head = spec["class"] in VOCAB_CLASSES
            layer, rows = _head(engine, spec["shards"][0]["N"], VOCAB_CLASSES[spec["class"]]) if head else \
                (_layer(engine, "linear", spec["class"]), None)
            try:
                method = cfg.get_quant_method(layer, lname)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            scheme = getattr(layer, "scheme", None)
            r["transforms"] = _transforms(method)
            if spec["class"] == "VocabParallelEmbedding":
                _embedding(engine, layer, method, rows, spec, tensors, request, r)
                continue
            if scheme is None:
                r["method"] = type(method).__name__ if method is not None else None
                continue
            r["scheme"], r["args"] = _short(type(scheme).__name__), _scheme_args(scheme)
            resolved = cfg.get_scheme_dict(layer, lname)
            r["inputs"] = resolved is not None and resolved.get("input_activations") is not None
            try:
                sizes = [rows] if head else [s["N"] for s in spec["shards"]]  # a head: padded rows
                # a transform method creates its scheme's parameters and its transforms' own
                (method if r["transforms"] else scheme).create_weights(
                    layer=layer, output_size=sum(sizes), input_size=spec["K"], output_partition_sizes=sizes,
                    input_size_per_partition=spec["K"], params_dtype=torch.bfloat16, weight_loader=None)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"create_weights: {type(e).__name__}: {str(e)[:200]}"
                continue
            r["args"] = _scheme_args(scheme)  # with the kernel a scheme picks in create_weights
            if r["args"].get("kernel_quantizes_inputs", False) is None:  # Humming: the layer's input config
                r["args"]["kernel_quantizes_inputs"] = hasattr(layer, "_humming_input_quant_config")
            r["load_errors"], r["never_loaded"], r["casts"], r["skipped"] = _load(engine, layer, spec["class"],
                                                                                  spec["shards"], tensors)
            r["values"] = _values(layer, request, r)
            if r["transforms"]:
                r["transform_values"] = _transform_values(layer)
        if art.get("attention"):
            attn = _layer(engine, "attention", "Attention" if engine == "vllm" else "RadixAttention")
            attn.num_kv_heads = art["num_kv_heads"]
            try:
                m = cfg.get_quant_method(attn, art["attention"])
                res["kv"] = {"method": None if m is None else type(m).__name__, "error": None}
            except Exception as e:  # noqa: BLE001
                res["kv"] = {"method": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def _transforms(method) -> dict | None:
    """The transforms vLLM's `get_quant_method` wrapped a Linear's method in to run around it
    (`CompressedTensorsLinearTransformMethod`, from the config's `transform_config`): scheme name
    and location per partition, None where it runs the method as it is."""
    if type(method).__name__ not in ("CompressedTensorsLinearTransformMethod", "QutlassNvFP4LinearMethod"):
        return None
    return {side: {str(i): f"{t.scheme_name}:{getattr(t.args.location, 'value', t.args.location)}"
                   for i, t in getattr(method, side).items()} for side in ("input_tfms", "output_tfms")}


def _transform_values(layer) -> dict:
    """The matrices each transform module vLLM's transform method registered on `layer` holds after
    loading, per partition (as loaded: before `process_weights_after_loading` normalizes them),
    and whether the partitions of its input transform share one tensor, as vLLM requires."""
    out = {}
    for name, mod in layer.named_children():
        parts = getattr(getattr(mod, "weight", None), "partitions", None)
        if parts is None:
            continue
        ptrs = {p.data.data_ptr() for p in parts.values()}
        out[name] = {"parts": {str(i): p.data.float().tolist() for i, p in parts.items()}, "shared": len(ptrs) == 1}
    return out


def _embedding(engine: str, layer, method, rows: int, spec: dict, tensors: dict, request: dict, r: dict) -> None:
    """An input embedding: the method the engine's `get_quant_method` gave it creates its
    parameters as `VocabParallelEmbedding.__init__` asks (over the padded vocabulary, with the
    layer's own weight loader), and every tensor of the artifact is loaded through that loader.
    Where the engine gives none, it builds its `UnquantizedEmbeddingMethod`, whose one
    parameter, `weight`, the compressed tensors cannot fill (that method's module imports the
    distributed runtime, so its one parameter is stated here)."""
    import torch

    if method is None:
        r["method"] = None
        r["load_errors"] = [f"unexpected tensor {leaf}" for leaf in tensors.get(spec["shards"][0]["name"], {})]
        r["never_loaded"] = ["weight"]
        return
    r["scheme"], r["args"] = _short(type(method).__name__), _scheme_args(method)
    try:  # as in a float32 model: the lookup's rows come out in the scales' dtype, and Triton's
        # interpreter casts fp32 to bf16 by truncation where a GPU rounds to nearest
        method.create_weights(layer, spec["K"], [rows], spec["K"], rows, params_dtype=torch.float32,
                              weight_loader=layer.weight_loader)
    except Exception as e:  # noqa: BLE001
        r["error"] = f"create_weights: {type(e).__name__}: {str(e)[:200]}"
        return
    r["load_errors"], r["never_loaded"], r["casts"], r["skipped"] = _load(engine, layer, spec["class"],
                                                                          spec["shards"], tensors)
    r["values"] = _values(layer, request, r)
    ids = request.get("embedding_ids")
    if ids and not (r["load_errors"] or r["never_loaded"]):  # the rows its own lookup gives
        layer.weight_packed.data = layer.weight_packed.data.contiguous()
        try:
            r["rows"] = method.embedding(layer, torch.tensor(ids)).float().tolist()
        except Exception as e:  # noqa: BLE001
            r["rows_error"] = f"{type(e).__name__}: {str(e)[:200]}"


def _values(layer, request: dict, r: dict) -> dict:
    """The loaded values of the scales the request sent (the parameters as loaded, before the
    engine's post-processing)."""
    params = dict(layer.named_parameters())
    return {leaf: {"dtype": str(params[leaf].dtype).removeprefix("torch."),
                   "data": params[leaf].detach().float().reshape(-1).tolist()}
            for leaf in request["value_leaves"] if leaf in params and leaf not in r["never_loaded"]}


def _tensor(spec):
    import torch

    dtype = getattr(torch, spec["dtype"])
    data = spec.get("data")
    if data is not None:
        return torch.tensor(data, dtype=dtype).reshape(spec["shape"])
    return torch.zeros(spec["shape"], dtype=dtype)


def main() -> None:
    engine, source, ct_dir, request = sys.argv[1:5]
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors
    sys.path.insert(0, ct_dir)
    import compressed_tensors  # noqa: F401 — the engine's pinned release, before anything else
    import torch  # noqa: F401
    import transformers  # noqa: F401

    install(engine, source, int(json.load(open(request)).get("capability", 90)))
    VOCAB_CODE[engine] = _vocab_code(engine, source)
    try:
        out = {"result": run(engine, json.load(open(request))),
               "compressed_tensors": compressed_tensors.__version__,
               "compressed_tensors_file": compressed_tensors.__file__,
               "stubbed": sorted(set(STUBBED))}
    except Exception:  # noqa: BLE001
        out = {"fatal": traceback.format_exc()}
    json.dump(out, sys.stdout, default=repr)


if __name__ == "__main__":
    main()
