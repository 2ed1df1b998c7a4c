"""GPTQ for draft modules: the Hessians of an MTP module's, Medusa heads' or an EAGLE-3 head's
Linears, measured on its base's hidden states over calibration windows.

A draft module reads what its base computes, so its calibration data is the base's: each window
runs through the float base once, and the module then runs on those states as it drafts —

- an EAGLE-3 head on the aux layers' features, unrolled for `EAGLE3_DEPTHS` drafts on its own
  outputs as the training-time test and drafting unroll it (`eagle3_train.ttt_outputs`), its
  `lm_head` on every draft;
- an MTP module on the base's pre-norm states and the next tokens, then once more on its own
  outputs (a chain of `MTP_DEPTHS` drafts);
- Medusa heads on the base's final-normed states, every head.

Forward pre-hooks on the quantized Linears accumulate H = 2/n Σ x xᵀ once per input (Linears that
read one tensor, q / k / v and gate / up, share it). Every Hessian comes from the float module:
GPTQ's per-block recipe, the module being one block. `calib.ptq.quantize_model(hessians=)`
then runs GPTQ on each Linear with its Hessian.

The base is `--base`, or the one the module's config.json records: its training's
(`quantspec.training.base`; an MTP module's `quantspec_training.base`) or a speculators-format
head's verifier (`speculators_config.verifier.name_or_path`). It must be the float base the module
was made for (the kind's own check: sizes, vocabulary, layer fingerprint, rotations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from quantspec.calib.ptq import SHARED_INPUT_GROUPS
from quantspec.errors import QuantSpecError, about
from quantspec.quant.gptq import HessianAccumulator

__all__ = ["DRAFT_WHAT", "EAGLE3_DEPTHS", "MTP_DEPTHS", "check_base", "draft_base", "draft_hessians", "draft_passes",
           "draft_request", "load_base", "load_draft", "smoothing_refusal"]

# drafts per position the module is unrolled for while its inputs are measured (the default chain)
EAGLE3_DEPTHS = 4
MTP_DEPTHS = 2
# a draft module's kind (`model_zoo.checkpoint.draft_kind`) as messages name it
DRAFT_WHAT = {"mtp": "an MTP module", "medusa": "Medusa heads", "eagle3": "an EAGLE-3 head"}
# `calib.ptq.SHARED_INPUT_GROUPS` of more than one Linear, by the leaf names a draft module's Linears end in
_SHARED = tuple(tuple(n.rpartition(".")[2] for n in g) for g in SHARED_INPUT_GROUPS if len(g) > 1)


def draft_request(config, model_dir: Path, kind: str | None) -> Path | None:
    """Refuse, naming the flag, what `quantize` (a `calib.quantize.QuantizeConfig`) does not do with
    the model at `model_dir` (`kind`: the draft module's, `DRAFT_WHAT`; None: a base model) → the
    base a draft module's GPTQ (and static plan) is measured on (None: no such run, or a static
    plan on the base its table names). A draft module's static scales come from its own table
    (`calib.draft_scales`)."""
    what = DRAFT_WHAT.get(kind)
    if what is None:
        if config.base is not None:
            raise QuantSpecError(f"--base is a draft module's base and {model_dir} is not a draft module; "
                                 "drop --base")
        return None
    if config.method not in ("rtn", "gptq"):
        raise QuantSpecError(f"{model_dir} is {what}: quantize it with --method rtn or gptq (AWQ and AutoRound "
                             "are for base models)")
    why = smoothing_refusal(kind, config.smoothquant_alpha, config.static)
    if why is not None:
        raise QuantSpecError(f"{model_dir} is {what}: {why}; drop --smoothquant-alpha or change it")
    if config.fallback_budget is not None:
        raise QuantSpecError(f"{model_dir} is {what}: --a8w8-fallback-budget is a base model's perplexity budget; "
                             "use --a8w8-fallback-threshold E or --a8w8-fallback-layers N")
    if config.kv_cache is not None and kind != "eagle3":
        raise QuantSpecError(f"{model_dir} is {what}, which keeps no KV cache of its own; drop --kv-cache")
    if config.method == "gptq":
        return draft_base(config.base, model_dir)
    return draft_base(config.base, model_dir) if config.static and config.base is not None else None


def smoothing_refusal(kind: str | None, alpha, static: bool = True) -> str | None:
    """Why a draft module of `kind` takes no SmoothQuant at `alpha` (`--smoothquant-alpha`) for
    static (`static`) or per-token inputs (None: it does, or none is asked for)."""
    if alpha is None or alpha == "none":
        return None
    if kind == "medusa":
        return "Medusa heads have no norm for SmoothQuant's factors to fold into"
    if not static:
        return "SmoothQuant of inputs quantized per token is for base models"
    if alpha == "auto":
        return "--smoothquant-alpha auto searches α on a base model's layers; give a number (e.g. 0.5)"
    return None


def draft_base(base: str | None, model_dir: Path) -> Path:
    """The base directory of the draft module at `model_dir`: `base` (`--base`), or the one its
    training recorded."""
    from quantspec.model_zoo.checkpoint import read_config, resolve_model_dir

    cfg = read_config(model_dir)
    # quantspec's training (an MTP module's beside its config, the others' in it), a speculators head's verifier
    training = (cfg.get("quantspec") or {}).get("training") or cfg.get("quantspec_training") or {}
    recorded = training.get("base") or ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if base is None and not recorded:
        raise QuantSpecError(f"{model_dir} records no base (neither quantspec's training nor a speculators "
                             "verifier); pass the model it drafts for with --base")
    with about("--base"):
        return resolve_model_dir(base if base is not None else recorded)


def load_draft(model_dir: Path, config: dict, dtype: torch.dtype = torch.float32) -> nn.Module | None:
    """The float draft module at `model_dir` (config.json `config`) in `dtype`: an MTP module,
    Medusa heads or an EAGLE-3 head (None: not a draft module)."""
    from quantspec.model_zoo.eagle3 import is_eagle3_config, load_eagle3
    from quantspec.model_zoo.medusa import is_medusa_config, load_medusa
    from quantspec.model_zoo.mtp import is_mtp_config, load_mtp

    for is_it, load in ((is_mtp_config, load_mtp), (is_medusa_config, load_medusa), (is_eagle3_config, load_eagle3)):
        if is_it(config):
            with about("--model"):
                return load(model_dir, dtype=dtype)
    return None


def load_base(base_dir: Path, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The float base at `base_dir` a draft module is measured on, frozen, on `device`."""
    from quantspec.model_zoo.checkpoint import load_model

    with about("--base"):
        return load_model(base_dir, dtype=dtype, device=device)[0].requires_grad_(False)


def check_base(module: nn.Module, base_dir: Path) -> None:
    """Refuse, naming `--base`, before any work: a quantized base, or one `module` was not made
    for (the kind's own check of sizes, vocabulary, fingerprint and rotations), by its config."""
    from quantspec.model_zoo.checkpoint import read_config
    from quantspec.model_zoo.llama import ModelArgs

    with about("--base"):
        cfg = read_config(base_dir)
        if cfg.get("quantization_config"):
            raise QuantSpecError(f"{base_dir} is quantized; pass the float base it was made from (a draft "
                                 "module is calibrated on the float base's hidden states)")
        _check_kind(module, ModelArgs.from_hf_config(cfg))


def _check_kind(module: nn.Module, base_args) -> None:
    from quantspec.model_zoo.eagle3 import Eagle3Head, check_eagle3_matches_base
    from quantspec.model_zoo.medusa import MedusaHeads, check_medusa_matches_base
    from quantspec.model_zoo.mtp import check_mtp_matches_base

    if isinstance(module, Eagle3Head):
        check_eagle3_matches_base(module.args, base_args, where="the EAGLE-3 head")
    elif isinstance(module, MedusaHeads):
        check_medusa_matches_base(module.args, base_args, where="the Medusa heads")
    else:
        check_mtp_matches_base(module.args, base_args, where="the MTP module")


def draft_passes(module: nn.Module, base: nn.Module, windows: torch.Tensor) -> Iterator[int]:
    """Run `module` (an MTP module, Medusa heads or an EAGLE-3 head, bound to and checked against
    `base`) as it drafts on each window of `windows` [n, S]: yields the window's index after its
    pass (module docstring)."""
    from quantspec.model_zoo.eagle3 import Eagle3Head
    from quantspec.model_zoo.eagle3_train import ttt_outputs
    from quantspec.model_zoo.llama import DenseCausalAttention
    from quantspec.model_zoo.medusa import MedusaHeads

    eagle3, medusa, run = isinstance(module, Eagle3Head), isinstance(module, MedusaHeads), {}
    with about("--base"):  # the module's own check of its base, and its binding to it
        _check_kind(module, base.args)
        if eagle3:
            module.bind_embedding(base.model.embed_tokens)
            run["capture"] = tuple(module.args.aux_layers(base.args.num_layers))
        elif not medusa:
            module.bind_base(base)
    dev = base.model.norm.weight.device
    for i, window in enumerate(windows):
        ids = window.to(dev, torch.int64)
        S = ids.numel()
        out = base(ids, torch.arange(S, device=dev), DenseCausalAttention.of(base.args, 1, S), **run)
        if eagle3:
            for h in ttt_outputs(module, ids, torch.cat(out[1], dim=-1), EAGLE3_DEPTHS):
                module.logits(h)
        elif medusa:
            module(base.model.norm(out))
        else:
            h = out[:-1]
            for depth in range(MTP_DEPTHS):
                h = module(h[:S - 1 - depth], ids[1 + depth:])
        yield i


def _input_groups(linears: Mapping[str, nn.Linear]) -> list[list[str]]:
    """The Linears by the input they read: q / k / v and gate / up of one block together, any
    other alone."""
    groups, taken = [], set()
    for name in linears:
        if name in taken:
            continue
        stem, _, leaf = name.rpartition(".")
        shared = next((g for g in _SHARED if leaf in g), (leaf,))
        group = [m for m in (f"{stem}.{x}" if stem else x for x in shared) if m in linears]
        groups.append(group)
        taken.update(group)
    return groups


@torch.no_grad()
def draft_hessians(module: nn.Module, base: nn.Module, windows: torch.Tensor, config,
                   on_status: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """GPTQ's Hessian of each Linear of the draft `module` that `config` (a `QuantConfig`)
    quantizes, from its drafting passes over `windows` [n, S] on its float `base` (`load_base`)
    → {Linear name: H [K, K]} (module docstring)."""
    from quantspec.calib.targets import quantized_linears

    say = on_status or (lambda _m: None)
    linears = quantized_linears(module, config)
    accs, handles = {}, []
    for group in _input_groups(linears):
        first = linears[group[0]]
        acc = accs[tuple(group)] = HessianAccumulator(first.in_features, device=first.weight.device)
        handles.append(first.register_forward_pre_hook(lambda _m, inputs, acc=acc: acc.update(inputs[0])))
    say(f"measuring the draft module's inputs on {windows.shape[0]} × {windows.shape[1]} tokens of its base")
    n, every = windows.shape[0], max(1, windows.shape[0] // 4)
    try:
        for i in draft_passes(module.eval(), base, windows):
            if (i + 1) % every == 0 and i + 1 < n:  # a few lines: the passes take a while on a big base
                say(f"measured {i + 1}/{n} windows")
    finally:
        for h in handles:
            h.remove()
    out = {}
    for group, acc in accs.items():
        if not acc.num_samples:
            raise QuantSpecError(f"{group[0]} reads nothing while the module drafts; add it to --ignore")
        H = acc.take()
        out.update({n: H if j == 0 else H.clone() for j, n in enumerate(group)})
    return out
