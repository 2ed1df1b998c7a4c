"""Perplexity through the inference path: the model the engine runs, over the paged KV cache.

`perplexity` takes token ids (a text tokenized as one stream) and cuts them into non-overlapping
windows of `seq_len` tokens (the tail that does not fill a window is dropped; `max_windows`
keeps the first N). Each batch of windows is one
prefill of the `Transformer` with a `PagedAttention` backend over a `PagedKVCache` — exactly how
the engine runs a prompt — so a static int8/fp8 KV cache (`kv_cache_dtype` + `k_scale`/`v_scale`
[num_layers, num_kv_heads]) and quantized linears affect perplexity as they affect generation.

Per window of tokens t_0..t_{S-1}, the NLL of t_1..t_{S-1} given their prefixes is summed;
perplexity = exp(total NLL / number of predicted tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError, positive_int
from quantspec.infer.kv_cache import KVCacheDtype, PagedAttention, PagedKVCache
from quantspec.model_zoo.llama import Transformer

__all__ = ["PerplexityResult", "perplexity", "windows"]

DEFAULT_BLOCK_SIZE = 64


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean NLL per predicted token (nats)
    num_windows: int
    num_tokens: int  # predicted tokens: num_windows * (seq_len - 1)
    seq_len: int
    kv_cache_dtype: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def windows(token_ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """token_ids [N] → non-overlapping windows [W, seq_len] (tail dropped, first max_windows)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise QuantSpecError(f"--seq-len {seq_len!r} must be an integer ≥ 2")
    if max_windows is not None:
        positive_int("max_windows", max_windows)
    n = token_ids.numel() // seq_len
    if n == 0:
        raise QuantSpecError(f"the text has {token_ids.numel()} tokens, fewer than --seq-len "
                             f"{seq_len}; pass more text or a smaller --seq-len")
    if max_windows is not None:
        n = min(n, max_windows)
    return token_ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()  # scoring only: no autograd graph over the windows (a model's parameters may want grads)
def perplexity(model: Transformer, token_ids: torch.Tensor, *, seq_len: int = 512,
               max_windows: int | None = None, batch_size: int = 4,
               kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` [N] (see module docstring).

    progress(windows_done, num_windows) is called after each batch of windows.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 1:
        raise QuantSpecError("token_ids must be a 1-D LongTensor of token ids")
    positive_int("batch_size", batch_size)
    if int(token_ids.max()) >= model.args.vocab_size:
        raise QuantSpecError(f"token id {int(token_ids.max())} is outside the model's vocab "
                             f"({model.args.vocab_size}); the tokenizer does not match the model")
    t0 = time.perf_counter()
    win = windows(token_ids, seq_len, max_windows)  # [W, S]
    W, S = win.shape
    device = model.model.norm.weight.device
    dtype = model.model.norm.weight.dtype
    args = model.args
    if model.cos is None or model._rope_len < S:
        model.setup_rope(max(S, args.max_position_embeddings), device)
    blocks_per_seq = -(-S // block_size)
    B = min(batch_size, W)
    cache = PagedKVCache.of(args, num_blocks=B * blocks_per_seq + 1, block_size=block_size, dtype=dtype,
                            device=device, kv_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    total_nll, total_tokens = 0.0, 0
    for w0 in range(0, W, B):
        batch = win[w0:w0 + B].to(device)  # [b, S]
        b = batch.shape[0]
        tables = [cache.allocator.allocate(blocks_per_seq) for _ in range(b)]
        try:
            meta = cache.metadata([S] * b, [S] * b, tables, device)
            hidden = model(batch.reshape(-1), torch.arange(S, device=device).repeat(b),
                           PagedAttention(cache, meta))  # [b*S, D]
            hidden = hidden.view(b, S, -1)
            for j in range(b):  # logits one window at a time: [S, V] bounds memory
                logits = model.compute_logits(hidden[j, :-1])  # [S-1, V] fp32
                total_nll += float(F.cross_entropy(logits, batch[j, 1:], reduction="sum"))
                total_tokens += S - 1
        finally:
            for t in tables:
                cache.allocator.free(t)
        if progress is not None:
            progress(w0 + b, W)
    nll = total_nll / total_tokens
    if not math.isfinite(nll):
        raise QuantSpecError("the model produced NaN/Inf logits on the eval text; the model or "
                             "its quantization is broken (try --dtype float32)")
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, num_windows=W,
                            num_tokens=total_tokens, seq_len=S,
                            kv_cache_dtype=KVCacheDtype(kv_cache_dtype).value,
                            seconds=round(time.perf_counter() - t0, 3))
