"""Perplexity through the inference path: the model the engine runs, over the paged KV cache.

`perplexity` takes token ids (a text tokenized as one stream) and cuts them into non-overlapping
windows of `seq_len` tokens (the tail that does not fill a window is dropped; `max_windows`
keeps the first N). Each batch of windows is one
prefill of the `Transformer` with a `PagedAttention` backend over a `PagedKVCache` — exactly how
the engine runs a prompt — so a static int8/fp8 KV cache (`kv_cache_dtype` + `k_scale`/`v_scale`
[num_layers, num_kv_heads]) and quantized linears affect perplexity as they affect generation.

Per window of tokens t_0..t_{S-1}, the NLL of t_1..t_{S-1} given their prefixes is summed;
perplexity = exp(total NLL / number of predicted tokens).

`compare` runs a model and a reference (the model it was quantized from) over the same windows and
scores the model against the reference's next-token distributions at every position: the KL
divergence KL(p_ref ‖ p_model) = Σ_v p_ref(v) (log p_ref(v) − log p_model(v)) and top-1 agreement
(the measures llama.cpp's `--kl-divergence` reports), beside both perplexities. They see what
perplexity averages away: a quantized model can match its reference's perplexity and still move
many next-token choices.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from quantspec.errors import QuantSpecError, positive_int
from quantspec.infer.kv_cache import KVCacheDtype, PagedAttention, PagedKVCache
from quantspec.model_zoo.llama import Transformer

__all__ = ["ComparisonResult", "PerplexityResult", "compare", "perplexity", "window_logits", "windows"]

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


def _check_ids(model: Transformer, token_ids: torch.Tensor) -> None:
    if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 1:
        raise QuantSpecError("token_ids must be a 1-D LongTensor of token ids")
    if int(token_ids.max()) >= model.args.vocab_size:
        raise QuantSpecError(f"token id {int(token_ids.max())} is outside the model's vocab "
                             f"({model.args.vocab_size}); the tokenizer does not match the model")


@torch.no_grad()  # scoring only: no autograd graph over the windows (a model's parameters may want grads)
def window_logits(model: Transformer, win: torch.Tensor, *, batch_size: int = 4,
                  kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, block_size: int = DEFAULT_BLOCK_SIZE
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per window of `win` [W, S], in order: (logits [S-1, V] fp32 of positions 0..S-2, the tokens
    they predict [S-1]), from one prefill per batch of `batch_size` windows over a paged KV cache
    (module docstring); one window's logits at a time bounds memory."""
    positive_int("batch_size", batch_size)
    W, S = win.shape
    device, dtype, args = model.model.norm.weight.device, model.model.norm.weight.dtype, model.args
    if model.cos is None or model._rope_len < S:
        model.setup_rope(max(S, args.max_position_embeddings), device)
    blocks_per_seq = -(-S // block_size)
    B = min(batch_size, W)
    cache = PagedKVCache.of(args, num_blocks=B * blocks_per_seq + 1, block_size=block_size, dtype=dtype,
                            device=device, kv_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    for w0 in range(0, W, B):
        batch = win[w0:w0 + B].to(device)  # [b, S]
        b = batch.shape[0]
        tables = [cache.allocator.allocate(blocks_per_seq) for _ in range(b)]
        try:
            meta = cache.metadata([S] * b, [S] * b, tables, device)
            hidden = model(batch.reshape(-1), torch.arange(S, device=device).repeat(b),
                           PagedAttention(cache, meta)).view(b, S, -1)  # [b, S, D]
        finally:
            for t in tables:
                cache.allocator.free(t)
        for j in range(b):
            yield model.compute_logits(hidden[j, :-1]).float(), batch[j, 1:]


def perplexity(model: Transformer, token_ids: torch.Tensor, *, seq_len: int = 512,
               max_windows: int | None = None, batch_size: int = 4,
               kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` [N] (see module docstring).

    progress(windows_done, num_windows) is called after each window.
    """
    _check_ids(model, token_ids)
    positive_int("batch_size", batch_size)
    t0 = time.perf_counter()
    win = windows(token_ids, seq_len, max_windows)  # [W, S]
    total_nll, total_tokens = 0.0, 0
    for i, (logits, targets) in enumerate(window_logits(model, win, batch_size=batch_size, kv_cache_dtype=kv_cache_dtype,
                                                        k_scale=k_scale, v_scale=v_scale, block_size=block_size)):
        total_nll += float(F.cross_entropy(logits, targets, reduction="sum"))
        total_tokens += targets.numel()
        if progress is not None:
            progress(i + 1, win.shape[0])
    nll = _finite(total_nll / total_tokens)
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, num_windows=win.shape[0],
                            num_tokens=total_tokens, seq_len=win.shape[1],
                            kv_cache_dtype=KVCacheDtype(kv_cache_dtype).value,
                            seconds=round(time.perf_counter() - t0, 3))


def _finite(nll: float) -> float:
    if not math.isfinite(nll):
        raise QuantSpecError("the model produced NaN/Inf logits on the eval text; the model or "
                             "its quantization is broken (try --dtype float32)")
    return nll


@dataclass
class ComparisonResult:
    """A model against a reference on the same windows: both perplexities, and per predicted token
    the KL divergence KL(reference ‖ model) of the next-token distributions (nats: mean, 99th
    percentile, max) and whether both models' top-1 tokens agree."""

    perplexity: float
    reference_perplexity: float
    delta_pct: float  # perplexity over the reference's, in percent
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agreement: float  # share of predicted tokens whose argmax is the reference's
    num_windows: int
    num_tokens: int
    seq_len: int
    kv_cache_dtype: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def compare(model: Transformer, reference: Transformer, token_ids: torch.Tensor, *, seq_len: int = 512,
            max_windows: int | None = None, batch_size: int = 4, kv: dict | None = None,
            reference_kv: dict | None = None, progress: Callable[[int, int], None] | None = None) -> ComparisonResult:
    """`model` against `reference` (same vocabulary) on the windows of `token_ids` [N] (module
    docstring); `kv` / `reference_kv`: each one's `window_logits` KV-cache keywords."""
    _check_ids(model, token_ids)
    _check_ids(reference, token_ids)
    if model.args.vocab_size != reference.args.vocab_size:
        raise QuantSpecError(f"the reference's vocabulary ({reference.args.vocab_size}) is not the model's "
                             f"({model.args.vocab_size}); pass the model it was quantized from as --reference")
    t0 = time.perf_counter()
    win = windows(token_ids, seq_len, max_windows)
    ours = window_logits(model, win, batch_size=batch_size, **(kv or {}))
    theirs = window_logits(reference, win, batch_size=batch_size, **(reference_kv or {}))
    nll, ref_nll, klds, agree = 0.0, 0.0, [], 0
    for i, ((lq, targets), (lp, _)) in enumerate(zip(ours, theirs)):
        logq, logp = F.log_softmax(lq, dim=-1), F.log_softmax(lp, dim=-1)  # [S-1, V]
        klds.append((logp.exp() * (logp - logq)).sum(-1).clamp_(min=0))  # [S-1]: rounding can dip below 0
        nll -= float(logq.gather(-1, targets[:, None]).sum())
        ref_nll -= float(logp.gather(-1, targets[:, None]).sum())
        agree += int((lq.argmax(-1) == lp.argmax(-1)).sum())
        if progress is not None:
            progress(i + 1, win.shape[0])
    kld = torch.cat(klds).double()
    n = kld.numel()
    ppl, ref_ppl = math.exp(_finite(nll / n)), math.exp(_finite(ref_nll / n))
    return ComparisonResult(perplexity=ppl, reference_perplexity=ref_ppl, delta_pct=100 * (ppl / ref_ppl - 1),
                            kld_mean=float(kld.mean()), kld_p99=float(torch.quantile(kld, 0.99)),
                            kld_max=float(kld.max()), top1_agreement=agree / n, num_windows=win.shape[0],
                            num_tokens=n, seq_len=win.shape[1],
                            kv_cache_dtype=KVCacheDtype((kv or {}).get("kv_cache_dtype", "auto")).value,
                            seconds=round(time.perf_counter() - t0, 3))
