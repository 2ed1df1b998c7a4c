"""A quantized checkpoint read as the float checkpoint it decompresses to, so `quantize` and
`calibrate` take an FP8, NVFP4, MXFP4, int8 or int4 checkpoint (compressed-tensors, transformers'
and vLLM's own FP8, ModelOpt's NVFP4, GPTQ's and AWQ's own formats) as their source the way they
take a float one: a block-FP8 release quantized to int4 with GPTQ, an int8 artifact re-quantized
with another recipe.

Every format the inference loader runs is read, after the same checks (`quant.artifact_plan`:
the whole checkpoint against its config, from its headers, before any work). Each quantized
Linear's `weight` is shown as `dequantize(q, scale, zero point)` of its compressed tensors, computed
in fp32 (`quant.primitives.dequantize`; exact for int and FP8 codes under 16-bit scales), read when
looked up: a layer at a time, as from a float checkpoint. The source's static input scales and
KV-cache scales are not shown (a new artifact calibrates its own); every other tensor is the
checkpoint's own, and its bytes are copied as they are where the new artifact keeps it float. A
permuted act-order index (GPTQ's desc_act), which vLLM no longer runs, is followed here, so such a
checkpoint re-quantizes into static act-order groups, which it does. A checkpoint with run-time
transforms (QuIP's) reads as the float model its engine computes: each transform undone into its
Linear's weight and bias, and its `transform_config` keeps only the transforms fused for good.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Iterable, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader, CheckpointTensors, read_config
from quantspec.model_zoo.layout import ShapedTensors
from quantspec.model_zoo.llama import ModelArgs
from quantspec.quant.artifact_plan import plan_artifact, weight_dims
from quantspec.quant.compressed import check_present, read_quantized_linear
from quantspec.quant.config import QuantConfig
from quantspec.quant.primitives import dequantize
from quantspec.quant.transforms import fused_groups_only, undo_online

__all__ = ["DecompressedReader", "DecompressedTensors", "float_nbytes", "source_quantization", "source_reader"]


def float_nbytes(reader: CheckpointReader, names: Iterable[str]) -> int:
    """The bytes `names` take in a reader that computes some tensors (a decompressed or rotated
    view): a tensor kept as stored (in `reader.ranges`) its stored bytes, any other its fp32 values'."""
    return sum(reader.ranges[n].nbytes if n in reader.ranges else 4 * math.prod(reader.shapes[n]) for n in names)


class DecompressedTensors(ShapedTensors):
    """A quantized checkpoint's tensors (a dict, or a `CheckpointTensors` that reads on lookup)
    seen as the float checkpoint they decompress to (module docstring); `weights` maps each
    decompressed `{Linear}.weight` to its Linear. A Linear run between run-time transforms
    (QuIP's, `quant.transforms`) reads as the float Linear computing the same, the transforms
    undone into its weight and bias (`undo_online`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], args: ModelArgs, qc: QuantConfig, where: str):
        plan = plan_artifact(tensors, args, qc, where=where, permuted_g_idx=True)
        for exp in plan.q_expected.values():
            check_present(plan.tensors, exp)
        plan.refuse_unexpected(args, where)
        self.plan = plan
        self.weights = {f"{name}.weight": name for name in plan.quantized}
        self.shapes = {k: tuple(s) for k, s in plan.float_table.items()}
        for w, name in self.weights.items():
            self.shapes[w] = weight_dims(plan.net.get_submodule(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        module, leaf = name.rsplit(".", 1)
        if module in self.plan.online and leaf in ("weight", "bias"):  # run-time transforms undone (QuIP's)
            wn = f"{module}.weight"
            w = self._weight(wn, module) if wn in self.weights else self.plan.tensors[wn]
            b = self.plan.tensors[f"{module}.bias"] if f"{module}.bias" in self.shapes else None
            w, b = undo_online(w, b, self.plan.online[module])
            return w if leaf == "weight" else b
        return self.plan.tensors[name] if name not in self.weights else self._weight(name, module)

    def _weight(self, name: str, module: str) -> torch.Tensor:
        N, K = self.shapes[name]
        t = read_quantized_linear(self.plan.tensors, module, self.plan.quantized[module], N, K)
        # in fp32: (q − z) · s of 8-bit codes and a 16-bit scale is exact there, rounded in the scale's dtype
        zp = t.zero_point.float() if t.zero_point is not None and t.zero_point.is_floating_point() else t.zero_point
        if module in self.plan.permuted:  # column k in group g_idx[k] (GPTQ's desc_act)
            g = self.plan.tensors[f"{module}.weight_g_idx"].long().reshape(-1)
            z = 0.0 if zp is None else zp.float()[:, g]
            return (t.q.float() - z) * t.scale.float()[:, g]
        return dequantize(t.q, t.scale.float(), zp, t.weight_args, dtype=torch.float32, global_scale=t.global_scale)


class DecompressedReader(CheckpointReader):
    """A `CheckpointReader` over a quantized checkpoint that reads it as the float checkpoint it
    decompresses to (`DecompressedTensors`): `shapes` are the float checkpoint's, `read` returns
    decompressed weights, `ranges` names only the tensors kept as stored (copied as they are).
    `source` is the checkpoint's `QuantConfig`, `source_method` its `quant_method`."""

    def __init__(self, model_dir: str | os.PathLike, cfg: dict | None = None):
        raw = CheckpointReader(model_dir)
        cfg = read_config(raw.model_dir) if cfg is None else cfg
        self.raw, self.model_dir = raw, raw.model_dir
        # the transforms left in the weights it reads: those fused into them (a QuIP checkpoint's are undone)
        qc = QuantConfig.from_dict(cfg["quantization_config"])
        self.source = replace(qc, transform_config=fused_groups_only(qc.transform_config))
        self.source_method = str(cfg["quantization_config"].get("quant_method") or "compressed-tensors")
        self.view = DecompressedTensors(CheckpointTensors(raw), ModelArgs.from_hf_config(cfg), qc, str(raw.model_dir))
        self.shapes = dict(self.view.shapes)
        self.stored, self.splits = raw.stored, {}
        self.ranges = {n: r for n, r in raw.ranges.items() if n in self.shapes and n not in self.view.weights
                       and n.rsplit(".", 1)[0] not in self.view.plan.online}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """The bytes `names` (default: every tensor of the checkpoint, as stored) take: a
        decompressed weight's are its fp32 values'."""
        if names is None:
            return self.raw.nbytes()
        return float_nbytes(self, names)

    def read(self, names: list[str], *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """{name: tensor} for `names` (decompressed weights in fp32 unless `dtype` says), each
        owning its memory."""
        out = {}
        for n in names:
            if n not in self.shapes:
                raise QuantSpecError(f"{self.model_dir} lacks {n}; the checkpoint is incomplete")
            t = self.view[n]
            out[n] = t.to(device=device, dtype=dtype or t.dtype)
            del t
        return out

    def rows(self, name: str, ids: torch.Tensor, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> torch.Tensor:
        """The rows `ids` of `name` [V, D] → [..., D]; a quantized embedding's from its table
        decompressed whole (its codes are not laid out in rows of the float checkpoint)."""
        if name not in self.view.weights:
            return super().rows(name, ids, dtype=dtype, device=device)
        table = self.read([name], dtype=dtype)[name]
        return table[ids.reshape(-1).cpu()].view(*ids.shape, table.shape[1]).to(device)


def source_reader(model_dir: str | os.PathLike, cfg: dict) -> CheckpointReader:
    """The reader of a source checkpoint of config.json `cfg`: a `DecompressedReader` when it is
    quantized (`quant.bnb.BnbReader` for a bitsandbytes one), else a `CheckpointReader`."""
    from quantspec.quant.bnb import BNB_METHOD, BnbReader

    qc = cfg.get("quantization_config")
    if not qc:
        return CheckpointReader(model_dir)
    return BnbReader(model_dir, cfg) if qc.get("quant_method") == BNB_METHOD else DecompressedReader(model_dir, cfg)


def source_quantization(reader: CheckpointReader) -> dict | None:
    """What a quantized source was (for an artifact's provenance): its quant_method, format and
    quant type; None for a float source."""
    if isinstance(getattr(reader, "source_quantization", None), dict):  # a reader that says it (`quant.bnb`)
        return dict(reader.source_quantization)
    qc = getattr(reader, "source", None)
    if qc is None:
        return None
    return {"quant_method": reader.source_method, "format": qc.format,
            "quant_type": getattr(qc.quant_type, "value", qc.quant_type)}
