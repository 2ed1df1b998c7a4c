"""`speculate_method = mtp`: drafts from a DeepSeek-V3-style MTP module (`model_zoo/mtp.py`).

The engine keeps, for each decoding sequence, the base's pre-norm hidden state at the position
that produced its newest token (`seq.last_hidden`, because this proposer sets `needs_hidden`).
That pair (h_i, t_{i+1}) is exactly the MTP's input, so a step drafts, batched over sequences:

    h, t = last_hidden, tokens[-1]
    for j in 1..k:  h = mtp(h, t);  t = pick(mtp.draft_logits(h))       # chained drafts

pick = argmax for greedy requests (draft probs None: deterministic drafts), or a draw from
q = logits_to_probs(draft logits, the request's temperature / top-k / top-p) for sampling
requests, returned as the draft probs so the verifier's rejection sampling stays lossless.
Recompute-free: the MTP block's attention is window-1 (see `model_zoo/mtp.py`), so it keeps no
KV cache and there is nothing to roll back when drafts are rejected — the next step starts from
the base's fresh hidden state. How many drafts a sequence gets is the back-off policy of
`spec/proposers.py` (`AdaptiveDraftLength`), with the MTP's cost per draft in the cost model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.dense_linear import all_linears_packed
from quantspec.infer.fused_layers import watch_holds
from quantspec.infer.sampler import logits_to_probs, sample, sampling_tensors
from quantspec.model_zoo.checkpoint import read_config
from quantspec.model_zoo.llama import Transformer
from quantspec.model_zoo.mtp import MTPArgs, MTPModule, check_mtp_matches_base, is_mtp_config, load_mtp

__all__ = ["FusedMTPStep", "MTPProposer", "build_mtp_proposer", "load_mtp_for_inference", "mtp_draft_cost"]

# per-draft Python/launch overhead on top of the weight cost, in base decode steps (CPU, batch 1)
_DRAFT_OVERHEAD = 0.02


def _bytes_touched(module: torch.nn.Module, skip: torch.nn.Module | None = None) -> int:
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


def mtp_draft_cost(mtp: MTPModule, base: Transformer) -> float:
    """One draft's cost in base decode steps: a decode step of either model on a CPU is bound by
    reading its weights, so the ratio of the bytes read per token (+ a fixed overhead)."""
    op = mtp._shared.get("head_op")
    head = _bytes_touched(op) if op is not None else mtp._shared["head"].numel() * mtp._shared["head"].element_size()
    base_bytes = _bytes_touched(base, skip=base.model.embed_tokens)
    return (_bytes_touched(mtp.model) + head) / max(1, base_bytes) + _DRAFT_OVERHEAD


def load_mtp_for_inference(path: str | Path, base: Transformer, *, dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None) -> MTPModule:
    """Load an MTP artifact for `base` (checked to match it) and bind it to the base."""
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
        mtp = _load_quantized_mtp(path, cfg, dtype, device).bind_base(base)
    else:
        mtp = load_mtp(path, base, dtype=dtype, device=device)
    return _prepare_for_cpu(mtp) if torch.device(device).type == "cpu" else mtp


def _prepare_for_cpu(mtp: MTPModule) -> MTPModule:
    """The base's CPU treatment for the draft module: q/k/v and gate/up fused, float linears and
    norms on quantspec's CPU kernels where they are built (a draft is one row per sequence:
    torch's 1-row float linear is a single-threaded GEMV). The draft-vocabulary head (the base
    head's rows, fp32) drafts in int8 (`dense_linear.PackedInt8Linear`: a quarter of the bytes
    to read each draft step, acceptance unchanged — a draft is only a proposal)."""
    from torch import nn

    from quantspec.infer.cpu_layers import use_cpu_layer_kernels
    from quantspec.infer.dense_linear import PackedInt8Linear, pack_float_linears, use_skinny_linears
    from quantspec.infer.fuse import fuse_projections
    from quantspec.kernels.cpu import cpu_kernels

    head = mtp._shared["head"]  # [Vd, D]
    kernels = cpu_kernels()
    if kernels is not None and head.dtype == torch.float32:
        head_op = PackedInt8Linear(head, kernels)
    else:  # a Linear over the same tensor, given the float-linear path
        head_op = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta", dtype=head.dtype)
        head_op.weight = nn.Parameter(head, requires_grad=False)
        use_skinny_linears(head_op)
    mtp._shared["head_op"] = head_op
    use_skinny_linears(mtp)
    use_cpu_layer_kernels(mtp)
    fuse_projections(mtp)
    pack_float_linears(mtp)
    return mtp


def _load_quantized_mtp(path: Path, cfg: dict, dtype: torch.dtype, device) -> MTPModule:
    """A compressed-tensors MTP artifact (e.g. `quantspec quantize --model MTP_DIR`): built on
    meta, each targeted Linear replaced by a `QuantLinear` from its tensors (the same reader as
    the base's loader), the float tensors (norms, draft vocabulary) loaded with `assign=True`."""
    from torch import nn

    from quantspec.infer.quant_linear import QuantLinear
    from quantspec.model_zoo.checkpoint import check_against_table, load_checkpoint_tensors
    from quantspec.model_zoo.mtp import DRAFT_VOCAB_NAME, mtp_weight_table
    from quantspec.quant.args import QuantConfig

    where = str(path)
    qc = QuantConfig.from_dict(cfg["quantization_config"])
    args = MTPArgs.from_config(cfg, where)
    with torch.device("meta"):
        mtp = MTPModule(args)
    quantized = {}
    for name, mod in mtp.named_modules():
        if isinstance(mod, nn.Linear):
            scheme = qc.scheme_for(name, ("Linear",))
            if scheme is not None and scheme.weights is not None:
                quantized[name] = scheme
    tensors = load_checkpoint_tensors(path)
    table = mtp_weight_table(args)
    for name in quantized:
        table.pop(f"{name}.weight")
    check_against_table(tensors, table, where)
    for name, scheme in quantized.items():
        lin = mtp.get_submodule(name)
        mtp.set_submodule(name, QuantLinear.from_tensors(tensors, name, scheme, lin.out_features, lin.in_features,
                                                         dtype=dtype, device=device))
    q_biases = {f"{name}.bias" for name in quantized}
    state = {k: (tensors[k] if k == DRAFT_VOCAB_NAME else tensors[k].to(dtype)).to(device)
             for k in table if k not in q_biases}
    mtp.load_state_dict(state, strict=False, assign=True)
    left = [n for n, p in list(mtp.named_parameters()) + list(mtp.named_buffers()) if p.is_meta]
    if left:
        raise QuantSpecError(f"{where}: tensors missing for {left[0]}; the artifact is incomplete")
    return mtp.eval()


class FusedMTPStep:
    """`mtp(h, t)` and `mtp.draft_logits(...)` in one call of the extension's `MTPPlan`: the calls
    the modules make, in their order, without Python between them — bitwise the modules' result
    (tested). In the engine (its weights cold after the base's forward) the default model's int8
    MTP drafted in 1.21-1.28 ms a step through the modules, 0.62-0.82 ms with this and the int8
    draft head; the fp32 MTP 1.29-1.36 → 1.20-1.25 ms (its 16.8 MB block dominates).

    Built only where the plan runs exactly the modules' kernels (a CPU module prepared by
    `_prepare_for_cpu`: kernel norms / attention / MLP, fused q/k/v and gate/up, packed fp32 or
    int8 / int4 row-kernel linears, the int8 draft head or a packed fp32 one); a call returns
    None — the modules run —
    when a module or tensor was swapped since, a forward hook is registered on one of them (or
    globally), or a quantized linear would leave its row kernel for that many rows.
    `QUANTSPEC_FUSED_LAYERS=0` turns it off, as it does the base's stack.
    """

    def __init__(self, mtp: MTPModule, plan, dtype: torch.dtype, watched: list[tuple], max_rows: int | None):
        self.mtp, self.plan, self.dtype, self.max_rows = mtp, plan, dtype, max_rows
        self._watch = [list(t) for t in zip(*watched)]
        mods = [*mtp.model.modules(), *mtp._shared["head_op"].modules()]
        self._hook_dicts = [d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def build(cls, mtp: MTPModule) -> "FusedMTPStep | None":
        from quantspec.infer.cpu_layers import KernelRMSNorm
        from quantspec.infer.fused_layers import ENV_SWITCH, layer_plan_args, linear_plan_args
        from quantspec.kernels.cpu import cpu_kernels

        if os.environ.get(ENV_SWITCH, "1") == "0" or "head_op" not in mtp._shared:
            return None
        kernels = cpu_kernels()
        if kernels is None or not hasattr(kernels, "MTPPlan"):
            return None
        m, args = mtp.model, mtp.args.block
        dtype, eps = m.norm.weight.dtype, m.norm.eps
        norms = (m.enorm, m.hnorm, m.norm)
        if (m.norm.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or len(m.layers) != 1
                or any(type(n) is not KernelRMSNorm or n.weight.dtype != dtype or n.eps != eps for n in norms)):
            return None
        tensors, ints, limits = [m.enorm.weight, m.hnorm.weight], [], []
        watched: list[tuple] = [(n._parameters, "weight", n.weight) for n in norms]
        # (eh_proj and the head are watched by `linear_plan_args`, the layer's parts by `layer_plan_args`)
        watched += [(m._modules, name, m._modules[name]) for name in ("enorm", "hnorm", "norm", "layers")]
        watched += [(m.layers._modules, "0", m.layers[0]), (mtp.__dict__, "_attn", mtp._attn),
                    (mtp.__dict__, "_shared", mtp._shared)]
        if (not linear_plan_args(m._modules, "eh_proj", dtype, tensors, ints, watched, limits)
                or not layer_plan_args(m.layers[0], args, dtype, eps, tensors, ints, watched, limits)):
            return None
        tensors.append(m.norm.weight)
        if not linear_plan_args(mtp._shared, "head_op", dtype, tensors, ints, watched, limits):
            return None
        plan = kernels.MTPPlan(tensors, ints, args.num_heads, args.num_kv_heads, args.head_dim, float(eps))
        return cls(mtp, plan, dtype, watched, min(limits) if limits else None)

    def __call__(self, h: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """h [A, D], token_ids [A] → (the MTP's hidden [A, D], draft logits [A, Vd] fp32), or
        None where the modules must run."""
        if h.dtype != self.dtype or h.dim() != 2 or h.shape[0] == 0:
            return None
        if self.max_rows is not None and h.shape[0] > self.max_rows:
            return None
        if not watch_holds(*self._watch, self._hook_dicts):
            return None
        emb = self.mtp._shared["embed"](token_ids).to(h.dtype)  # as MTPModule.forward
        x, logits = self.plan.forward(h, emb)
        return x, logits.float()


class MTPProposer:
    """Chained MTP drafts for a batch of sequences (module docstring).

    max_draft_tokens: `speculate_max_draft_token_num`; `policy` (an `AdaptiveDraftLength`)
    picks k per sequence, None always asks for min(max_draft_tokens, budget).
    """

    needs_hidden = True

    def __init__(self, mtp: MTPModule, max_draft_tokens: int = 5, *, policy=None, min_confidence: float = 0.0):
        if not mtp._shared:
            raise QuantSpecError("the MTP module is not bound to its base; call mtp.bind_base(base) first")
        if not 0.0 <= min_confidence < 1.0:
            raise QuantSpecError(f"--speculate-min-confidence {min_confidence} must be in [0, 1)")
        self.mtp, self.max_draft_tokens, self.policy = mtp, int(max_draft_tokens), policy
        # a sequence's drafting stops at the first draft whose top probability (over the draft
        # vocabulary) is below this: unconfident drafts are mostly rejected and each costs a verify
        # row. The choice depends only on the draft side, so verification stays lossless.
        self.min_confidence = float(min_confidence)
        self.fused = FusedMTPStep.build(mtp)  # None: the modules run

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        ks = [(self.policy.num_drafts(s, b) if self.policy is not None else min(self.max_draft_tokens, b))
              for s, b in zip(seqs, budgets)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor] | None] = [None for _ in seqs]
        live = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and s.last_hidden is not None]
        if not live:
            return drafts, [None] * len(seqs)
        mtp = self.mtp
        dev, dtype = mtp.model.norm.weight.device, mtp.model.norm.weight.dtype
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
            out = self.fused(h, tok) if self.fused is not None else None
            if out is None:
                h = mtp(h, tok)  # [A, D]
                logits = mtp.draft_logits(h)  # [A, Vd]
            else:
                h, logits = out
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
            nxt = mtp.draft_vocab_ids[logits.argmax(dim=-1)]  # [A] greedy picks (full-vocab ids)
            samp = [r for r, i in enumerate(live) if probs[i] is not None]
            if samp:
                rows = torch.tensor(samp, device=dev)
                params = [seqs[live[r]].params for r in samp]
                full = mtp.to_full_vocab(logits[rows])  # [S, V], -inf outside the draft vocabulary
                temp, top_k, top_p = sampling_tensors(params, dev)
                q = logits_to_probs(full, temp, top_k, top_p)  # [S, V]
                nxt[rows] = sample(q, [seqs[live[r]].generator for r in samp])
                for n, r in enumerate(samp):
                    probs[live[r]].append(q[n])
            picked = nxt.tolist()
            for r, i in enumerate(live):
                drafts[i].append(picked[r])
            keep = [r for r, i in enumerate(live) if ks[i] > j + 1]
            if not keep:
                break
            if len(keep) < len(live):
                live, h, nxt = narrow(keep, h, nxt)
            tok = nxt
        return drafts, [torch.stack(p) if p else None for p in probs]

    def release(self, seq) -> None:
        if self.policy is not None:
            self.policy.forget(seq)


MTP_BACKOFF_DECAY, MTP_MAX_PROBE_INTERVAL = 0.9, 8


def build_mtp_proposer(config, loaded) -> tuple[MTPProposer, int]:
    """`--speculate-method mtp --draft-model DIR`: load the MTP artifact for the base in `loaded`
    (a `LoadedModel`) and wrap it with the back-off policy. → (proposer, max drafts per step)."""
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost

    if not config.draft_model:
        raise QuantSpecError("--speculate-method mtp needs --draft-model DIR (an MTP module from `quantspec zoo train-mtp`)")
    base = loaded.model
    mtp = load_mtp_for_inference(config.draft_model, base)
    k = int(config.speculate_max_draft_token_num)
    device = base.model.norm.weight.device
    # An MTP draft is cheap (~0.07 of a base step here) and already gated by its confidence, so
    # a longer acceptance memory (decay 0.9) and short probe intervals (≤ 8 steps; worst case
    # (C(1) - 1) / 8 ≈ 3% when nothing is ever accepted) keep it from backing off after a short
    # unlucky run. Measured on the default model (chat, gate 0.3, 1 thread): the generic
    # policy (0.8, ≤ 32) 1.08x, this one 1.12x, no back-off 1.13-1.14x.
    cost = SpecCost.for_device(device, draft_per_token=mtp_draft_cost(mtp, base), packed_cpu=all_linears_packed(base))
    policy = AdaptiveDraftLength(k, cost,
                                 decay=MTP_BACKOFF_DECAY, max_probe_interval=MTP_MAX_PROBE_INTERVAL)
    return MTPProposer(mtp, k, policy=policy if getattr(config, "speculate_backoff", True) else None,
                       min_confidence=float(getattr(config, "speculate_min_confidence", 0.0))), k
