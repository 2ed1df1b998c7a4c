"""A draft head's static KV cache: an EAGLE-3 artifact quantized with `--kv-cache int8|fp8` holds
per-head `midlayer.self_attn.k_scale` / `v_scale` and a `kv_cache_scheme`, and the head's cache
then holds int8 / float8_e4m3fn codes of its keys and values at those scales, as the paged cache
of a base model does (`infer.kv_cache`) and as an engine serving the head with a quantized KV
cache runs it. MTP modules and Medusa heads keep no KV cache: a `kv_cache_scheme` on them is
refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from quantspec.errors import QuantSpecError

__all__ = ["HeadKV", "head_kv"]


@dataclass(frozen=True)
class HeadKV:
    """Codes of `kind` ("int8" / "fp8") at per-KV-head scales `k_scale` / `v_scale` [KV] fp32."""

    kind: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        """The cache's storage dtype."""
        return torch.int8 if self.kind == "int8" else torch.float8_e4m3fn

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k / v [T, KV, hd] → their codes."""
        from quantspec.quant.primitives import quantize_kv

        return quantize_kv(k, self.k_scale, self.kind), quantize_kv(v, self.v_scale, self.kind)

    def load(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [T, KV, hd] → k / v in `dtype`."""
        from quantspec.quant.primitives import dequantize_kv

        return dequantize_kv(k, self.k_scale, dtype), dequantize_kv(v, self.v_scale, dtype)


def head_kv(qc, tensors: Mapping[str, torch.Tensor], attention: str | None, num_kv_heads: int, where: str,
            what: str, device) -> HeadKV | None:
    """The static KV cache of a draft artifact with quantization config `qc` (a `QuantConfig`) and
    `tensors`, whose attention is `attention` (None: the module keeps no KV cache) → None where
    the artifact has no `kv_cache_scheme`."""
    from quantspec.infer.loader import kv_scale_rows

    kv = qc.kv_cache_scheme
    if kv is None:
        return None
    if attention is None:
        raise QuantSpecError(f"{where} has a kv_cache_scheme, and {what} keep no KV cache; re-quantize it "
                             "without --kv-cache")
    k, v = kv_scale_rows(tensors, [attention], num_kv_heads, where)
    return HeadKV("fp8" if kv.type == "float" else "int8", k[0].to(device), v[0].to(device))
