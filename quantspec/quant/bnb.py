"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`: QLoRA's NF4 / FP4 `load_in_4bit`,
LLM.int8's `load_in_8bit`, the `*-bnb-4bit` releases) read as the float checkpoint they
decompress to, so `quantize` and `calibrate` take them as a source: vLLM 0.33 has no bitsandbytes
method at all, and an artifact quantspec writes from one (e.g. int4 GPTQ) loads there.

The layout is the one transformers saves and SGLang's loader reads. A 4-bit Linear keeps its
codes two to a byte (`weight`, uint8, or those bytes viewed as `bnb_4bit_quant_storage`; the first
code in the high nibble) over the row-major
flattened weight, a scale per `blocksize` codes (`weight.absmax`), the 16-entry code table
(`weight.quant_map`), and a JSON blob (`weight.quant_state.bitsandbytes__nf4` / `__fp4`, uint8)
with the shape, dtype and block size; with double quantization (`bnb_4bit_use_double_quant`) the
scales are themselves 8-bit codes (`absmax` uint8) into `weight.nested_quant_map` times one float
per `nested_blocksize` scales (`weight.nested_absmax`), plus `nested_offset`. w = quant_map[code] ·
absmax[block], computed in fp32 and rounded to the blob's dtype, as bitsandbytes' own
`dequantize_4bit` does. An 8-bit Linear keeps int8 `weight` [N, K] and its rows' absmax `SCB`:
w = weight · SCB / 127. Modules `llm_int8_skip_modules` names (and every non-Linear) are float.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.quant.decompressed import float_nbytes

__all__ = ["BNB_METHOD", "BnbReader", "bnb_description", "bnb_inspect", "dequantize_4bit", "dequantize_8bit"]

BNB_METHOD = "bitsandbytes"
_STATE = "quant_state.bitsandbytes__"
_LEAVES_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_LEAVES_8BIT = ("SCB", "weight_format")


def bnb_description(qc: dict, where: str) -> dict:
    """What a bitsandbytes `quantization_config` asks for ({"bits": 4 | 8, "quant_type": "nf4" /
    "fp4" / "int8", "double_quant": bool}), refused in one line where it is not a saved checkpoint."""
    four, eight = bool(qc.get("load_in_4bit")), bool(qc.get("load_in_8bit"))
    if four == eight:
        raise QuantSpecError(f"{where}: a bitsandbytes config sets exactly one of load_in_4bit / load_in_8bit; "
                             "re-save the checkpoint with transformers")
    if four:
        qt = str(qc.get("bnb_4bit_quant_type") or "fp4")
        if qt not in ("nf4", "fp4"):
            raise QuantSpecError(f"{where}: bnb_4bit_quant_type {qt!r} is neither nf4 nor fp4")
        return {"bits": 4, "quant_type": qt, "double_quant": bool(qc.get("bnb_4bit_use_double_quant"))}
    return {"bits": 8, "quant_type": "int8", "double_quant": False}


def _state(tensors: dict, name: str) -> dict:
    key = next((k for k in tensors if k.startswith(f"{name}.weight.{_STATE}")), None)
    if key is None:
        raise QuantSpecError(f"{name} has 4-bit codes but no weight.{_STATE}nf4 / fp4 entry; the checkpoint is "
                             "incomplete")
    try:
        return json.loads(bytes(tensors[key].reshape(-1).tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        raise QuantSpecError(f"{key} is not bitsandbytes' JSON quant state; the checkpoint is corrupt") from None


def dequantize_4bit(tensors: dict, name: str) -> torch.Tensor:
    """The float weight [N, K] of the 4-bit Linear `name` from its tensors (module docstring),
    in fp32 (rounded through the quant state's dtype, as bitsandbytes returns it)."""
    st = _state(tensors, name)
    shape, blocksize = tuple(int(s) for s in st["shape"]), int(st["blocksize"])
    codes = tensors[f"{name}.weight"].contiguous().reshape(-1)
    if codes.dtype != torch.uint8:  # `bnb_4bit_quant_storage` (bf16 for FSDP QLoRA): the same bytes
        codes = codes.view(torch.uint8)
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    if codes.dtype != torch.uint8 or codes.numel() * 2 < n:
        raise QuantSpecError(f"{name}.weight holds {codes.numel()} {codes.dtype} bytes, not the {n} 4-bit codes of "
                             f"shape {list(shape)}; the checkpoint is corrupt")
    blocks = -(-n // blocksize)
    absmax, code = _leaf(tensors, name, "absmax", blocks), _leaf(tensors, name, "quant_map", 16)
    if "nested_blocksize" in st:  # double quantization: the scales are 8-bit codes themselves
        nb = int(st["nested_blocksize"])
        code2 = _leaf(tensors, name, "nested_quant_map", 256).float()
        scale2 = _leaf(tensors, name, "nested_absmax", -(-blocks // nb)).float()
        absmax = code2[absmax.long()] * scale2[torch.arange(blocks) // nb] + float(st["nested_offset"])
    absmax = absmax.float()
    idx = torch.empty(codes.numel() * 2, dtype=torch.long)
    idx[0::2], idx[1::2] = (codes >> 4).long(), (codes & 0xF).long()
    vals = code.float()[idx[:n]]
    if vals.numel() < absmax.numel() * blocksize:
        vals = torch.cat([vals, vals.new_zeros(absmax.numel() * blocksize - n)])
    w = (vals.view(-1, blocksize) * absmax.view(-1, 1)).reshape(-1)[:n]
    dtype = getattr(torch, str(st.get("dtype", "float32")), torch.float32)
    return w.reshape(shape).to(dtype).float()


def _leaf(tensors: dict, name: str, leaf: str, size: int) -> torch.Tensor:
    """`{name}.weight.{leaf}` flattened, refused in one line where it is missing or not `size` long."""
    t = tensors.get(f"{name}.weight.{leaf}")
    if t is None or t.numel() != size:
        got = "missing" if t is None else f"{t.numel()} values"
        raise QuantSpecError(f"{name}.weight.{leaf} is {got}, not the {size} its quant state implies; the "
                             "checkpoint is corrupt")
    return t.reshape(-1)


def dequantize_8bit(tensors: dict, name: str) -> torch.Tensor:
    """The float weight [N, K] of LLM.int8's Linear `name`: weight · SCB / 127 per row (as
    bitsandbytes' `int8_vectorwise_dequant` computes it)."""
    w, scb = tensors[f"{name}.weight"], tensors.get(f"{name}.SCB", torch.empty(0)).float().reshape(-1)
    if w.dtype != torch.int8 or w.ndim != 2 or scb.numel() != w.shape[0]:
        raise QuantSpecError(f"{name}: weight {tuple(w.shape)} {w.dtype} and SCB {tuple(scb.shape)} are not "
                             "LLM.int8's int8 rows and their scales; the checkpoint is corrupt")
    return w.float() * scb.view(-1, 1) * (1 / 127)  # bitsandbytes' order: times the fp32 reciprocal


class BnbReader(CheckpointReader):
    """A bitsandbytes checkpoint read as the float checkpoint it decompresses to: `shapes` are the
    float checkpoint's (the quant states' tensors hidden), `read` returns decompressed weights in
    fp32, `ranges` names only the tensors kept as stored. `source_quantization`: what it was."""

    def __init__(self, model_dir: str | os.PathLike, cfg: dict):
        raw = CheckpointReader(model_dir)
        self.raw, self.model_dir, self.stored, self.splits = raw, raw.model_dir, raw.stored, {}
        desc = bnb_description(cfg["quantization_config"], f"{raw.model_dir}/config.json")
        self.bits = desc["bits"]
        self.source_quantization = {"quant_method": BNB_METHOD, "format": desc["quant_type"],
                                    "quant_type": desc["quant_type"] + (" double-quant" if desc["double_quant"] else "")}
        leaves = _LEAVES_4BIT if self.bits == 4 else _LEAVES_8BIT
        marker = ".weight.absmax" if self.bits == 4 else ".SCB"
        self.linears = sorted(n[: -len(marker)] for n in raw.shapes if n.endswith(marker))
        hidden = {f"{m}.weight.{leaf}" for m in self.linears for leaf in leaves} | \
            {f"{m}.{leaf}" for m in self.linears for leaf in leaves} | \
            {n for n in raw.shapes if f".weight.{_STATE}" in n}
        self.shapes = {n: s for n, s in raw.shapes.items() if n not in hidden}
        for m in self.linears:
            self.shapes[f"{m}.weight"] = self._float_shape(m)
        quantized = {f"{m}.weight" for m in self.linears}
        self.ranges = {n: r for n, r in raw.ranges.items() if n in self.shapes and n not in quantized}

    def _tensors(self, m: str) -> dict:
        names = [n for n in self.raw.shapes if n == f"{m}.weight" or n.startswith(f"{m}.weight.") or n == f"{m}.SCB"]
        return self.raw.read(names)

    def _float_shape(self, m: str) -> tuple[int, ...]:
        if self.bits == 8:
            return tuple(self.raw.shapes[f"{m}.weight"])
        key = next((n for n in self.raw.shapes if n.startswith(f"{m}.weight.{_STATE}")), None)
        if key is None:
            raise QuantSpecError(f"{self.model_dir}: {m} has 4-bit scales but no weight.{_STATE}nf4 / fp4 entry; "
                                 "the checkpoint is incomplete")
        return tuple(int(s) for s in _state(self.raw.read([key]), m)["shape"])

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        if names is None:
            return self.raw.nbytes()
        return float_nbytes(self, names)

    def read(self, names: list[str], *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            if n not in self.shapes:
                raise QuantSpecError(f"{self.model_dir} lacks {n}; the checkpoint is incomplete")
            m = n[: -len(".weight")] if n.endswith(".weight") else None
            if m in self.linears:
                t = (dequantize_4bit if self.bits == 4 else dequantize_8bit)(self._tensors(m), m)
            else:
                t = self.raw.read([n])[n]
            out[n] = t.to(device=device, dtype=dtype or t.dtype)
        return out


def bnb_inspect(model_dir: str | os.PathLike, cfg: dict) -> dict:
    """`inspect`'s description of a bitsandbytes checkpoint: what it holds and each engine's
    verdict (vLLM's and SGLang's method tables as the conformance suite reads them from their
    source; transformers loads it through the bitsandbytes package)."""
    from quantspec.quant.engines import ENGINE_VERSIONS, EngineVerdict

    reader = BnbReader(model_dir, cfg)
    what = reader.source_quantization["quant_type"]
    fix = (f"quantspec quantize --model {reader.model_dir} --quant-type weight_only_int4 --method gptq --dataset D "
           "--out OUT (an artifact every engine loads)",)
    v = ENGINE_VERSIONS
    verdicts = [
        EngineVerdict("vllm", "refused", (f"vLLM {v['vllm']} has no bitsandbytes quantization method",), fix),
        EngineVerdict("sglang", "loads", (f"SGLang {v['sglang']}'s BitsAndBytesConfig, on CUDA",)),
        EngineVerdict("transformers", "loads", (f"transformers {v['transformers']} with the bitsandbytes package",)),
        EngineVerdict("quantspec", "refused", ("quantspec has no NF4 / LLM.int8 kernel: it reads the checkpoint as a "
                                              "quantize / calibrate source",), fix)]
    return {"quantized": True, "quant_type": f"bitsandbytes {what}", "format": f"bitsandbytes {what}",
            "quantized_linears": len(reader.linears), "convert": fix[0],
            "engines": {e.engine: e.to_dict() for e in verdicts}}
