"""An EAGLE-3 head trained on a base, turned to read that base after `quantize --rotate` fused
rotations into it (`calib.rotate`): the same drafts, from the rotated base's hidden states.

The head reads the base twice. Its aux features are the base's residual stream, which R1 turns:
h' = h·R1, so `fc` takes R1 on each feature's columns, fc' = fc·diag(g)·blockdiag(R1, …), with the
weight g of a norm before it (`input_norm`, `fc_norm`) folded in first and set to ones (an RMSNorm
commutes with an orthogonal turn only without its per-channel weight). And it looks up the base's
embedding, now E·R1, which `input_layernorm` normalizes before q / k / v read it from their first
D columns: those take diag(g_e)·R1 the same way. R2 turns values inside the base's attention and
reaches no hidden state the head reads. Everything else of the head (its own residual stream,
norm, output head, draft vocabulary) is its own and stays.

The head written records the rotated base's fingerprint (which includes its rotations), so
quantspec refuses it beside the unrotated base and the unrotated head beside the rotated one. A
head's own copy of the embedding (published heads carry one) is left out: vLLM and SGLang then
read the base's, as quantspec does. Medusa heads cannot be turned this way (their residual blocks
add the normed hidden state, whose norm weight the rotated base folded into its output head):
train them on the rotated base.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from quantspec.calib.rotate import Rotation
from quantspec.errors import QuantSpecError, about

__all__ = ["rotate_eagle3_head"]


def rotate_eagle3_head(head_dir: str | os.PathLike, base_dir: str | os.PathLike, out: str | os.PathLike, *,
                       overwrite: bool = False) -> Path:
    """Write to `out` the unquantized EAGLE-3 head at `head_dir`, turned to read the rotated base at
    `base_dir` (module docstring); refused in one line where the base has no rotations quantspec
    fused or the head was made for it already."""
    from quantspec.model_zoo.checkpoint import read_config, resolve_model_dir
    from quantspec.model_zoo.eagle3 import (Eagle3Head, check_eagle3_matches_base, is_eagle3_config, load_eagle3,
                                            save_eagle3)
    from quantspec.model_zoo.hf_config import ROTATION_KEY
    from quantspec.model_zoo.llama import ModelArgs
    from quantspec.model_zoo.mtp import base_fingerprint
    from quantspec.outputs import check_output_dir

    out = check_output_dir(out, "--out", overwrite=overwrite)
    with about("--base"):
        base_cfg = read_config(resolve_model_dir(base_dir))
        rotation = Rotation.from_meta(base_cfg.get(ROTATION_KEY))
        if rotation is None:
            raise QuantSpecError(f"{base_dir} has no rotations quantspec fused into it (no {ROTATION_KEY} in its "
                                 "config.json); pass the artifact `quantize --rotate` wrote")
        base = ModelArgs.from_hf_config(base_cfg)
    with about("--model"):
        head_path = resolve_model_dir(head_dir)
        if not is_eagle3_config(read_config(head_path)):
            raise QuantSpecError(f"{head_path} is not an EAGLE-3 head; Medusa heads and MTP modules are trained "
                                 "on the rotated base instead")
        head = load_eagle3(head_path)
        if head.args.base_fingerprint == base_fingerprint(base):
            raise QuantSpecError(f"{head_path} was made for this rotated base already; use it as it is")
        args = replace(head.args, base_fingerprint=base_fingerprint(base))
        check_eagle3_matches_base(args, base, where=f"EAGLE-3 head {head_path}")
    R1 = rotation.matrix("R1", base.hidden_size)
    state = _turned(head.state_dict(), head.args, R1)
    with torch.device("meta"):
        turned = Eagle3Head(args)
    turned.load_state_dict(state, assign=True)
    return save_eagle3(turned, out)


def _turned(state: dict, args, R1: torch.Tensor) -> dict:
    """The head's tensors for the rotated base (module docstring), in their own dtypes."""
    out = dict(state)
    n, T, D = args.num_aux, args.target_hidden_size, args.layer.hidden_size
    fc = state["fc.weight"].double()  # [D, n·T]
    if args.norm_before_fc:
        fc, out["input_norm.weight"] = fc * state["input_norm.weight"].double(), torch.ones_like(state["input_norm.weight"])
    if args.fc_norm:
        g = torch.cat([state[f"fc_norm.{i}.weight"].double() for i in range(n)])
        fc = fc * g
        out |= {f"fc_norm.{i}.weight": torch.ones_like(state[f"fc_norm.{i}.weight"]) for i in range(n)}
    out["fc.weight"] = (fc.view(D, n, T) @ R1).reshape(D, n * T).to(state["fc.weight"].dtype)
    g_e = state["midlayer.input_layernorm.weight"].double()
    for proj in ("q_proj", "k_proj", "v_proj"):  # the embedding's half of the 2·D inputs
        key = f"midlayer.self_attn.{proj}.weight"
        w = state[key].double()
        w[:, :D] = (w[:, :D] * g_e) @ R1
        out[key] = w.to(state[key].dtype)
    out["midlayer.input_layernorm.weight"] = torch.ones_like(state["midlayer.input_layernorm.weight"])
    return out
