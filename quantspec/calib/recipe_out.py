"""`recipe.yaml` beside an artifact: the llm-compressor recipe of the quantize run that made it.

llm-compressor writes the recipe it ran beside every artifact (the `recipe.yaml` of its hub
models); quantspec writes one too wherever a recipe stands for the run, so the artifact says how it
was made in the terms llm-compressor users read, and `quantize --recipe ARTIFACT/recipe.yaml` (or
llm-compressor's `oneshot`) runs it again. The recipe is one stage of modifier groups:

- the run's transforms first: `SpinQuantModifier` for `--rotate` (R1 / R2 as random Hadamard
  matrices, R4 as Hadamard blocks in a group of its own), `QuIPModifier` for `--quip`,
  `SmoothQuantModifier` for one `--smoothquant-alpha`, `AWQModifier` for `awq` / `awq+gptq`;
- then the quantization modifier of the method (`QuantizationModifier`, `GPTQModifier` with its
  block, damping and column order, `AutoRoundModifier` with its steps), holding the run's schemes
  as compressed-tensors `config_groups` (the model's type on `Linear`, each `--layer-quant-type`
  on its targets), its `ignore` list and its `kv_cache_scheme`.

A run has no recipe where llm-compressor has no modifier for what it did: SmoothQuant α searched
per group, the float-input fallback of static a8w8 types, draft modules (MTP, Medusa, EAGLE-3
heads). `recipe_text` decides by reading its candidate back (`calib.recipe.read_recipe`): the
recipe is written only when it reads as the run's own options, field by field, scheme by scheme.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from quantspec.errors import QuantSpecError

__all__ = ["RECIPE_FILE", "recipe_file", "recipe_text"]

RECIPE_FILE = "recipe.yaml"
_QUANT_MODIFIER = {"rtn": "QuantizationModifier", "awq": "QuantizationModifier", "gptq": "GPTQModifier",
                   "awq+gptq": "GPTQModifier", "autoround": "AutoRoundModifier"}
# the options a recipe stands for beside the schemes (`calib.recipe.FLAGS` and the fallback's)
_COMPARED = ("method", "act_order", "block_size", "damp", "autoround", "awq_duo_scaling",
             "activations", "smoothquant_alpha", "fallback_layers", "fallback_threshold", "fallback_budget",
             "rotate", "quip", "quip_block_size")


def _groups(c, ignore: tuple[str, ...]) -> dict:
    """The modifier groups of the run `c` (a `calib.quantize.QuantizeConfig`) ignoring `ignore`, in
    the order they run."""
    qc = c.quant_config
    groups: dict = {}
    rotations = [r for r in (c.rotate or "").split(",") if r]
    if fused := [r for r in rotations if r != "R4"]:
        groups["rotate_modifiers"] = {"SpinQuantModifier": {"rotations": fused, "transform_type": "random-hadamard"}}
    if "R4" in rotations:
        groups["r4_modifiers"] = {"SpinQuantModifier": {"rotations": ["R4"], "transform_type": "hadamard"}}
    if c.quip is not None:
        quip = {"rotations": c.quip.split(","), "transform_type": "hadamard"}
        groups["quip_modifiers"] = {"QuIPModifier": quip | ({"transform_block_size": c.quip_block_size}
                                                            if c.quip_block_size else {})}
    if isinstance(c.smoothquant_alpha, float):
        groups["smoothing_modifiers"] = {"SmoothQuantModifier": {"smoothing_strength": c.smoothquant_alpha}}
    if c.method.startswith("awq"):
        duo = {"true": True, "false": False, "both": "both"}[c.awq_duo_scaling]
        groups["awq_modifiers"] = {"AWQModifier": {"duo_scaling": duo}}
    quant = {"config_groups": {k: s.to_dict() for k, s in qc.config_groups.items()}, "ignore": list(ignore)}
    if qc.kv_cache_scheme is not None:
        quant["kv_cache_scheme"] = qc.kv_cache_scheme.to_dict()
    if c.method.endswith("gptq"):
        quant.update(block_size=c.block_size, dampening_frac=c.damp, actorder="static" if c.act_order else None)
    elif c.method == "autoround":
        quant.update(iters=c.autoround.iters, lr=c.autoround.lr, batch_size=c.autoround.batch_size)
    groups["quant_modifiers"] = {_QUANT_MODIFIER[c.method]: quant}
    return groups


def recipe_file(c, src, scratch: Path) -> dict[str, Path]:
    """{`RECIPE_FILE`: its path in `scratch`} for the run `c` of a base model (`src`: its
    `calib.quantize._Source`) that a recipe stands for, else {}: the artifact's extra file
    (`quant.artifact.write_artifact`). The recipe ignores what the run left float, the Linears
    quantize keeps float by itself included (a mixture of experts' routers)."""
    text = recipe_text(c, scratch, src.quant_config.ignore) if src.kind is None else None
    if text is None:
        return {}
    path = scratch / RECIPE_FILE
    path.write_text(text, encoding="utf-8")
    return {RECIPE_FILE: path}


def recipe_text(c, scratch: Path, ignore: tuple[str, ...] | None = None) -> str | None:
    """The llm-compressor recipe (YAML) of the quantize run `c` ignoring `ignore` (None: the run's
    config's), or None where no recipe stands for it (module docstring); `scratch`: a directory to
    write the candidate into while it is read back."""
    import yaml

    from quantspec.calib.recipe import read_recipe

    ignore = tuple(c.quant_config.ignore if ignore is None else ignore)
    text = yaml.safe_dump({"quant_stage": _groups(c, ignore)}, sort_keys=False, width=110)
    path = scratch / RECIPE_FILE
    path.write_text(text, encoding="utf-8")
    try:
        again = _as_config(c, read_recipe(str(path)).merge({}))
    except (QuantSpecError, TypeError, ValueError):  # what llm-compressor's modifiers do not hold as quantspec runs it
        return None
    finally:
        path.unlink()
    qc = again.quant_config
    same = set(qc.ignore) == set(ignore) and qc == replace(c.quant_config, ignore=qc.ignore) and \
        all(getattr(again, f) == getattr(c, f) for f in _COMPARED)
    return text if same else None


def _as_config(c, options: dict):
    """The `QuantizeConfig` of `options` (a recipe's) for the run `c`'s model, data and target."""
    from quantspec.calib.quantize import QuantizeConfig

    keep = {f: getattr(c, f) for f in ("model", "out", "dataset", "calib", "target", "compute_capability", "base",
                                       "split", "text_field", "num_samples", "seq_len", "seed", "device")}
    return QuantizeConfig(**keep, **options)
