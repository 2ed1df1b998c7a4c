"""`speculate_method = mtp`: drafts from a DeepSeek-V3-style MTP module (`model_zoo/mtp.py`).

The engine keeps, for each decoding sequence, the base's pre-norm hidden state at the position
that produced its newest token (`seq.last_hidden`, because this proposer sets `needs_hidden`).
That pair (h_i, t_{i+1}) is exactly the MTP's input, so a step drafts, batched over sequences:

    h, t = last_hidden, tokens[-1]
    for j in 1..k:  h = mtp(h, t);  t = pick(mtp.draft_logits(h))       # chained drafts

pick = argmax for greedy requests (draft probs None: deterministic drafts), or a draw from
q = logits_to_probs(draft logits, the request's temperature and filters) for sampling
requests, returned as the draft probs so the verifier's rejection sampling stays lossless.
Recompute-free: the MTP block's attention is window-1 (see `model_zoo/mtp.py`), so it keeps no
KV cache and there is nothing to roll back when drafts are rejected — the next step starts from
the base's fresh hidden state. How many drafts a sequence gets is the back-off policy of
`spec/proposers.py` (`AdaptiveDraftLength`), with the MTP's cost per draft in the cost model.
The module is prepared for its device like a model (`infer.backend.prepare`): the runtime's draft
head and one-call draft step, where the backend has them, are handed to `MTPProposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.sampler import logits_to_probs, sample, sampling_tensors
from quantspec.infer.spec.types import SpecProposal
from quantspec.model_zoo.checkpoint import read_config
from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.mtp import MTPArgs, MTPModule, check_mtp_matches_base, is_mtp_config, load_mtp

__all__ = ["MTPProposer", "build_mtp_proposer", "check_min_confidence", "load_mtp_for_inference", "mtp_draft_cost"]

# per-draft Python/launch overhead on top of the weight cost, in base decode steps (CPU, batch 1)
_DRAFT_OVERHEAD = 0.02


def _bytes_touched(module: nn.Module, skip: nn.Module | None = None) -> int:
    """Bytes of the tensors a forward of `module` reads per token: every module's own parameters
    and buffers (float weights, packed weights, quantized codes, scales), each tensor once,
    leaving out `skip` (an embedding: a lookup reads one row)."""
    seen, n = set(), 0
    for m in module.modules():
        if m is skip:
            continue
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                n += t.numel() * t.element_size()
    return n


def mtp_draft_cost(mtp: MTPModule, base: Transformer, head: nn.Module | None = None) -> float:
    """One draft's cost in base decode steps: a decode step of either model on a CPU is bound by
    reading its weights, so the ratio of the bytes read per token (+ a fixed overhead). `head`:
    the draft head op it drafts with (None: the shared head's rows)."""
    w = mtp._shared["head"]
    head_bytes = _bytes_touched(head) if head is not None else w.numel() * w.element_size()
    base_bytes = _bytes_touched(base, skip=base.model.embed_tokens)
    return (_bytes_touched(mtp.model) + head_bytes) / max(1, base_bytes) + _DRAFT_OVERHEAD


def load_mtp_for_inference(path: str | Path, base: Transformer, *, dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None) -> MTPModule:
    """Load an MTP artifact for `base` (checked to match it) and bind it to the base (prepare it
    for its device with `infer.backend.prepare`)."""
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise QuantSpecError(f"--draft-model {path} has no config.json; pass a directory from `quantspec zoo train-mtp`")
    cfg = read_config(path)
    if not is_mtp_config(cfg):
        raise QuantSpecError(
            f"--draft-model {path} is not an MTP module (architectures {cfg.get('architectures')}); "
            f"use --speculate-method draft for a draft model, or train one with `quantspec zoo train-mtp`"
        )
    check_mtp_matches_base(MTPArgs.from_config(cfg, str(path)), base.args, where=f"MTP module {path}")
    dtype = dtype or base.model.norm.weight.dtype
    device = device or base.model.norm.weight.device
    if cfg.get("quantization_config"):
        return _load_quantized_mtp(path, cfg, dtype, device).bind_base(base)
    return load_mtp(path, base, dtype=dtype, device=device)


def _load_quantized_mtp(path: Path, cfg: dict, dtype: torch.dtype, device) -> MTPModule:
    """A compressed-tensors MTP artifact (e.g. `quantspec quantize --model MTP_DIR`)."""
    from quantspec.model_zoo.mtp import DRAFT_VOCAB_NAME, mtp_weight_table

    args = MTPArgs.from_config(cfg, str(path))
    with torch.device("meta"):
        mtp = MTPModule(args)
    return load_quantized_module(path, cfg, mtp, mtp_weight_table(args), (DRAFT_VOCAB_NAME,), dtype, device)


def load_quantized_module(path: Path, cfg: dict, module: nn.Module, table: dict, int_names: tuple[str, ...],
                          dtype: torch.dtype, device, what: str = "MTP modules", attention: str | None = None
                          ) -> nn.Module:
    """A compressed-tensors artifact of a draft-side module built on meta (`module`, its
    unquantized weight `table`): each targeted Linear replaced by a `QuantLinear` from its
    tensors (the same reader as the base's loader), the float tensors loaded with `assign=True`
    (`int_names` keep their dtype). A module with an `attention` (its name) gets the artifact's
    static KV cache as `module.kv_cache` (`spec.head_kv`); `what` (the kind, plural) names the
    others in the refusal of one."""
    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.infer.spec.head_kv import head_kv
    from quantspec.model_zoo.checkpoint import check_against_table, load_checkpoint_tensors
    from quantspec.quant.config import QuantConfig

    where = str(path)
    qc = QuantConfig.from_dict(cfg["quantization_config"])
    quantized = {}
    for name, mod in module.named_modules():
        if isinstance(mod, nn.Linear):
            scheme = qc.scheme_for(name, ("Linear",))
            if scheme is not None and scheme.weights is not None:
                quantized[name] = scheme
    tensors = load_checkpoint_tensors(path)
    table = dict(table)
    for name in quantized:
        table.pop(f"{name}.weight")
    check_against_table(tensors, table, where)
    for name, scheme in quantized.items():
        lin = module.get_submodule(name)
        module.set_submodule(name, QuantLinear.from_tensors(tensors, name, scheme, lin.out_features, lin.in_features,
                                                            dtype=dtype, device=device))
    q_biases = {f"{name}.bias" for name in quantized}
    state = {k: (tensors[k] if k in int_names else tensors[k].to(dtype)).to(device)
             for k in table if k not in q_biases}
    module.load_state_dict(state, strict=False, assign=True)
    left = [n for n, p in list(module.named_parameters()) + list(module.named_buffers()) if p.is_meta]
    if left:
        raise QuantSpecError(f"{where}: tensors missing for {left[0]}; the artifact is incomplete")
    attn = None if attention is None else module.get_submodule(attention)
    module.kv_cache = head_kv(qc, tensors, attention, getattr(attn, "num_kv_heads", 0), where, what, device)
    return module.eval()


@dataclass(frozen=True)
class HeadKind:
    """How a kind of draft head loads: `load(path, base_args, dtype=, device=)` an unquantized
    artifact; for a compressed-tensors one, `module(args)` builds it, `table(args)` is its
    unquantized weight table (`int_names` keep their dtype), `check_base(args, base_args, where=)`
    and `check(head, where)` check it. `what` names it in messages; `attention`, the module's
    attention whose keys and values it caches (None: it keeps no KV cache)."""

    what: str
    load: Callable
    module: Callable
    table: Callable
    int_names: tuple[str, ...]
    check_base: Callable
    check: Callable
    attention: str | None = None


def load_head_for_inference(path: Path, cfg: dict, args: Callable, base: Transformer, dtype: torch.dtype | None,
                            kind: HeadKind) -> nn.Module:
    """A draft head of `kind` for `base`, in `dtype` (None: the base's) on the base's device,
    checked against it; `args()` reads a quantized artifact's args from its config."""
    dev, dtype = base.model.norm.weight.device, dtype or base.model.norm.weight.dtype
    if not cfg.get("quantization_config"):
        return kind.load(path, base.args, dtype=dtype, device=dev)
    a = args()
    kind.check_base(a, base.args, where=f"{kind.what} {path}")
    with torch.device("meta"):
        head = kind.module(a)
    head = load_quantized_module(path, cfg, head, kind.table(a), kind.int_names, dtype, dev, kind.what, kind.attention)
    kind.check(head, str(path))
    return head


def check_min_confidence(value: float) -> float:
    """`--speculate-min-confidence` as the head drafters (MTP, EAGLE-3, Medusa) take it: a top-1
    probability in [0, 1), below which a sequence's drafting stops (0: never)."""
    if not 0.0 <= value < 1.0:
        raise QuantSpecError(f"--speculate-min-confidence {value} must be in [0, 1)")
    return float(value)


class MTPProposer:
    """Chained MTP drafts for a batch of sequences (module docstring).

    max_draft_tokens: `speculate_max_draft_token_num`; `policy` (an `AdaptiveDraftLength`)
    picks k per sequence, None always asks for min(max_draft_tokens, budget). `head`: the draft
    head op (`Runtime.draft_head`; None: the shared head's rows); `step`: the whole draft step in
    one call (`Runtime.draft_step`, returning None where the modules must run; None: the modules).
    """

    needs_hidden = True

    def __init__(self, mtp: MTPModule, max_draft_tokens: int = 5, *, policy=None, min_confidence: float = 0.0,
                 head: nn.Module | None = None, step: Callable | None = None):
        if not mtp._shared:
            raise QuantSpecError("the MTP module is not bound to its base; call mtp.bind_base(base) first")
        self.mtp, self.max_draft_tokens, self.policy = mtp, int(max_draft_tokens), policy
        # a sequence's drafting stops at the first draft whose top probability (over the draft
        # vocabulary) is below this: unconfident drafts are mostly rejected and each costs a verify
        # row. The choice depends only on the draft side, so verification stays lossless.
        self.min_confidence = check_min_confidence(min_confidence)
        self.head, self.step = head, step

    def _depth(self, h: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft depth: (the MTP's hidden [A, D], draft logits [A, Vd] fp32)."""
        out = self.step(h, tok) if self.step is not None else None
        if out is not None:
            return out
        h = self.mtp(h, tok)  # [A, D]
        return h, self.mtp.draft_logits(h, self.head)  # [A, Vd]

    def _pick(self, seqs: list, live: list[int], logits: torch.Tensor, probs: list) -> torch.Tensor:
        """The next draft of each live sequence [A] (full-vocab ids): the argmax, or a draw from
        q for a sampling sequence (q appended to its probs)."""
        mtp = self.mtp
        nxt = mtp.draft_vocab_ids[logits.argmax(dim=-1)]  # [A] greedy picks (full-vocab ids)
        samp = [r for r, i in enumerate(live) if probs[i] is not None]
        if samp:
            dev = logits.device
            rows = torch.tensor(samp, device=dev)
            params = [seqs[live[r]].params for r in samp]
            full = mtp.to_full_vocab(logits[rows])  # [S, V], -inf outside the draft vocabulary
            q = logits_to_probs(full, *sampling_tensors(params, dev))  # [S, V]
            nxt[rows] = sample(q, [seqs[live[r]].generator for r in samp])
            for n, r in enumerate(samp):
                probs[live[r]].append(q[n])
        return nxt

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        """The drafts of each sequence, with q [k_b, V] for a sampling sequence (else None)."""
        ks = [(self.policy.num_drafts(s, b) if self.policy is not None else min(self.max_draft_tokens, b))
              for s, b in zip(seqs, budgets)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor] | None] = [None for _ in seqs]
        live = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and s.last_hidden is not None]
        if live:
            self._chain(seqs, ks, live, drafts, probs)
        return SpecProposal([torch.tensor(d, dtype=torch.int64) for d in drafts],
                            [torch.stack(p) if p else None for p in probs])

    def _chain(self, seqs: list, ks: list[int], live: list[int], drafts: list[list[int]], probs: list) -> None:
        """Chained drafts of the `live` sequences, depth by depth, into `drafts` / `probs`."""
        dev, dtype = self.mtp.model.norm.weight.device, self.mtp.model.norm.weight.dtype
        h = torch.stack([seqs[i].last_hidden for i in live]).to(dev, dtype)  # [A, D]
        tok = torch.tensor([seqs[i].tokens[-1] for i in live], dtype=torch.int64, device=dev)  # [A]
        for i in live:
            if not seqs[i].params.is_greedy:
                probs[i] = []

        def narrow(keep: list[int], *rows: torch.Tensor):
            """Keep the live sequences at positions `keep` (and those rows of each tensor)."""
            idx = torch.tensor(keep, device=dev)
            return [live[r] for r in keep], *(t[idx] for t in rows)

        for j in range(max(ks[i] for i in live)):
            h, logits = self._depth(h, tok)
            if self.min_confidence > 0:  # an unsure sequence stops drafting at this depth
                conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
                for r, i in enumerate(live):
                    if conf[r] < self.min_confidence:
                        ks[i] = j
                keep = [r for r, i in enumerate(live) if ks[i] > j]
                if not keep:
                    break
                if len(keep) < len(live):
                    live, h, logits = narrow(keep, h, logits)
            picked = self._pick(seqs, live, logits, probs)
            for r, i in enumerate(picked.tolist()):
                drafts[live[r]].append(i)
            keep = [r for r, i in enumerate(live) if ks[i] > j + 1]
            if not keep:
                break
            if len(keep) < len(live):
                live, h, picked = narrow(keep, h, picked)
            tok = picked

    def release(self, seq) -> None:
        if self.policy is not None:
            self.policy.forget(seq)


MTP_BACKOFF_DECAY, MTP_MAX_PROBE_INTERVAL = 0.9, 8


def build_mtp_proposer(config, loaded) -> tuple[MTPProposer, int]:
    """`--speculate-method mtp --draft-model DIR`: load the MTP artifact for the base in `loaded`
    (a `LoadedModel`), prepare it for the base's device and wrap it with the back-off policy.
    → (proposer, max drafts per step)."""
    from quantspec.infer.backend import prepare
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost, loaded_runtime

    if not config.draft_model:
        raise QuantSpecError("--speculate-method mtp needs --draft-model DIR (an MTP module from `quantspec zoo train-mtp`)")
    base, base_runtime = loaded.model, loaded_runtime(loaded)
    mtp = load_mtp_for_inference(config.draft_model, base)
    runtime = prepare(mtp, base.model.norm.weight.device)
    k = int(config.speculate_max_draft_token_num)
    # An MTP draft is cheap and already gated by its confidence, so a longer acceptance memory
    # (decay 0.9) and short probe intervals (≤ 8 steps; worst case (C(1) - 1) / 8 when nothing is
    # ever accepted) keep it from backing off after a short unlucky run.
    cost = SpecCost.for_device(base_runtime.device, draft_per_token=mtp_draft_cost(mtp, base, runtime.draft_head),
                               packed_cpu=base_runtime.packed_rows)
    policy = AdaptiveDraftLength(k, cost,
                                 decay=MTP_BACKOFF_DECAY, max_probe_interval=MTP_MAX_PROBE_INTERVAL)
    return MTPProposer(mtp, k, policy=policy if getattr(config, "speculate_backoff", True) else None,
                       min_confidence=float(getattr(config, "speculate_min_confidence", 0.0)),
                       head=runtime.draft_head, step=runtime.draft_step), k
