"""Checkpoint layouts: the HF weight-name tables (`hf_weight_table`), and the checkpoints that
fuse what quantspec's modules keep apart.

Phi-3's checkpoints (Phi-3 / 3.5 mini and medium, Phi-4) store each attention's q, k and v
projections as one `self_attn.qkv_proj` and each MLP's gate and up projections as one
`mlp.gate_up_proj`, their rows stacked in that order. quantspec's modules, its quantizers and its
engine work on the parts (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`); the layout is
translated at the edges only:

- reading: `split_plan` names each part's tensors after the fused tensor they are rows of, and
  `part_shape` / `part_tensor` cut them out (`CheckpointReader` and `SplitTensors` present a
  fused checkpoint, float or quantized, under the parts' names);
- writing: `fuse_tensors` stacks a decoder layer's part tensors back into the fused names and
  `checkpoint_config` renames a `quantization_config`'s module names (whole units only), so an
  artifact keeps the layout transformers, vLLM and SGLang load (their Phi-3 classes hold
  `qkv_proj` / `gate_up_proj` as single Linears: one scheme, one input scale per unit);
- `checkpoint_name` maps a part's module name to the checkpoint's, for scheme lookups, and
  `part_config` a config's fused names (`--ignore model.layers.0.self_attn.qkv_proj`) to the parts'.

A fused compressed-tensors Linear splits by rows: codes and per-row scales and zero points are
rows of the parts' (zero points packed along rows, 32 / bits per word, split on word
boundaries); a per-tensor weight scale, the input scale and `weight_g_idx` are the unit's, so
each part takes a copy; `weight_shape` is rewritten per part. Fusing is the converse: per-tensor
values must agree across the parts, except a static input scale, where the unit takes the
largest (what vLLM does for separately stored shards).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import torch

from quantspec.errors import QuantSpecError

if TYPE_CHECKING:
    from quantspec.model_zoo.llama import ModelArgs

__all__ = ["FUSED", "ShapedTensors", "SplitTensors", "shapes_of", "checkpoint_config", "checkpoint_name", "fuse_tensors",
           "fused_units", "hf_weight_table", "layer_weight_table", "part_config", "part_shape", "part_tensor",
           "split_plan"]

# arch → (fused module, its parts in row order), relative to a decoder layer
FUSED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "phi3": (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))),
}
_LAYER = re.compile(r"^(model\.layers\.\d+)\.(.+)$")
# a fused tensor's leaves that are rows of the parts'; every other leaf is the unit's as a whole
_ROW_LEAVES = ("weight", "weight_packed", "bias", "weight_scale", "weight_zero_point")
# leaves whose value a fused unit holds once: an input scale may differ between parts (max taken)
_MAX_LEAVES = ("input_scale",)


def _rows(args, part: str) -> int:
    return {"self_attn.q_proj": args.q_size, "self_attn.k_proj": args.kv_size, "self_attn.v_proj": args.kv_size,
            "mlp.gate_proj": args.intermediate_size, "mlp.up_proj": args.intermediate_size}[part]


def fused_units(args) -> tuple[tuple[str, tuple[tuple[str, int, int], ...]], ...]:
    """The fused modules of `args.arch`, each with its parts as (name, first row, end row), names
    relative to a decoder layer; () for an architecture whose checkpoints keep the parts apart."""
    units = []
    for fused, parts in FUSED.get(getattr(args, "arch", None), ()):
        lo, spans = 0, []
        for p in parts:
            spans.append((p, lo, lo + _rows(args, p)))
            lo += _rows(args, p)
        units.append((fused, tuple(spans)))
    return tuple(units)


def checkpoint_name(args, module: str) -> str:
    """The checkpoint's name of the module that holds `module` (a part's fused module, else itself)."""
    m = _LAYER.match(module)
    if m:
        for fused, spans in fused_units(args):
            if any(m.group(2) == p for p, _, _ in spans):
                return f"{m.group(1)}.{fused}"
    return module


def split_plan(args, names) -> dict[str, tuple[str, int, int, int]]:
    """{part tensor name: (fused tensor name, first row, end row, the unit's rows)} for every fused
    tensor among `names` (a checkpoint's tensor names)."""
    units = {fused: spans for fused, spans in fused_units(args)}
    plan = {}
    if not units:
        return plan
    for name in names:
        m = _LAYER.match(name)
        if not m:
            continue
        module, _, leaf = m.group(2).rpartition(".")
        if module in units:
            spans = units[module]
            for part, lo, hi in spans:
                plan[f"{m.group(1)}.{part}.{leaf}"] = (name, lo, hi, spans[-1][2])
    return plan


def _word_rows(shape0: int, lo: int, hi: int, total: int, name: str) -> slice:
    """The rows of a tensor with one row per run of the unit's rows (`shape0` for `total` rows:
    packed zero-point words, FP8 block rows) that hold rows lo..hi."""
    per = -(-total // shape0)  # rows per word / block
    if -(-total // per) != shape0 or lo % per or (hi % per and hi != total):
        fix = "quantize the model with symmetric weights (no zero points)" if name.endswith("zero_point") \
            else "re-quantize it with blocks that end where its parts do"
        raise QuantSpecError(f"{name}: its {shape0} rows do not split at row {lo} / {hi} of {total}; {fix}")
    return slice(lo // per, -(-hi // per))


def _rows_of_parts(leaf: str, shape: tuple[int, ...], rows: int) -> bool:
    """Whether a tensor of `leaf` and `shape` in a unit of `rows` rows holds rows of the parts
    (else it is the unit's own: a per-tensor scale, an input scale, `weight_g_idx`)."""
    n = 1
    for d in shape:
        n *= d
    return leaf in _ROW_LEAVES and bool(shape) and not n == 1 < rows


def part_shape(name: str, shape: tuple[int, ...], lo: int, hi: int, total: int) -> tuple[int, ...]:
    """The shape of rows lo..hi of the fused tensor `name` of `shape` (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    if not _rows_of_parts(leaf, shape, total):
        return tuple(shape)
    if shape[0] == total:
        return (hi - lo, *shape[1:])
    if leaf in ("weight_zero_point", "weight_scale"):  # packed zero points, FP8 block scales
        s = _word_rows(shape[0], lo, hi, total, name)
        return (s.stop - s.start, *shape[1:])
    raise QuantSpecError(f"{name} has {shape[0]} rows where its fused module has {total}; the checkpoint and "
                         "config.json disagree")


def part_tensor(name: str, t: torch.Tensor, lo: int, hi: int, total: int) -> torch.Tensor:
    """Rows lo..hi of the fused tensor `name` (a copy that owns its memory; see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight_shape":
        return torch.tensor([hi - lo, int(t[1])], dtype=t.dtype)
    shape = part_shape(name, tuple(t.shape), lo, hi, total)
    if shape == tuple(t.shape):
        return t.clone()
    if t.shape[0] == total:
        return t[lo:hi].clone()
    return t[_word_rows(t.shape[0], lo, hi, total, name)].clone()


def shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name → shape of `tensors`: a `ShapedTensors`' own `shapes` (no data read), else each tensor's."""
    return getattr(tensors, "shapes", None) or {k: tuple(v.shape) for k, v in tensors.items()}


class ShapedTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping of tensors whose names and shapes (`shapes`: name → shape) are known
    without reading any data; a subclass reads a tensor in `__getitem__`."""

    shapes: dict[str, tuple[int, ...]]

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class SplitTensors(ShapedTensors):
    """A mapping of checkpoint tensors (a dict, or a `CheckpointTensors` that reads on lookup) seen
    under the parts' names: each fused tensor is replaced by its parts (`split_plan`), cut out
    when looked up."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], args):
        self.base = tensors
        base_shapes = shapes_of(tensors)
        self.plan = split_plan(args, base_shapes)
        fused = {src for src, _, _, _ in self.plan.values()}
        self.shapes = {k: tuple(s) for k, s in base_shapes.items() if k not in fused}
        for name, (src, lo, hi, total) in self.plan.items():
            self.shapes[name] = part_shape(src, tuple(base_shapes[src]), lo, hi, total)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.plan:
            src, lo, hi, total = self.plan[name]
            return part_tensor(src, self.base[src], lo, hi, total)
        if name not in self.shapes:
            raise KeyError(name)
        return self.base[name]


class RenamedLeaves(ShapedTensors):
    """A mapping of checkpoint tensors seen with some leaf names replaced: `leaves` maps the name
    shown to the stored one (`{"weight_scale": "weight_scale_inv"}` shows `x.weight_scale` for a
    stored `x.weight_scale_inv`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], leaves: Mapping[str, str]):
        self.base = tensors
        stored = {v: k for k, v in leaves.items()}
        base_shapes = shapes_of(tensors)
        self.names = {}  # shown → stored
        for k in base_shapes:
            module, _, leaf = k.rpartition(".")
            self.names[f"{module}.{stored[leaf]}" if leaf in stored and module else k] = k
        self.shapes = {shown: tuple(base_shapes[k]) for shown, k in self.names.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.base[self.names[name]]


def fuse_tensors(args, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (part names) with each complete unit's part tensors stacked under the fused name,
    in the order given; the converse of `split_plan` (module docstring)."""
    units = fused_units(args)
    if not units:
        return dict(tensors)
    part_of = {p: (fused, spans) for fused, spans in units for p, _, _ in spans}
    out: dict[str, torch.Tensor] = {}
    taken: set[str] = set()
    for name in tensors:
        m = _LAYER.match(name)
        module, _, leaf = m.group(2).rpartition(".") if m else ("", "", "")
        if module not in part_of:
            out[name] = tensors[name]
            continue
        if name in taken:
            continue
        fused, spans = part_of[module]
        names = [f"{m.group(1)}.{p}.{leaf}" for p, _, _ in spans]
        lacking = [n for n in names if n not in tensors]
        if lacking:
            raise QuantSpecError(f"{name} is written without {', '.join(lacking)}: a {args.arch} checkpoint "
                                 f"stores them as one {fused}")
        full = f"{m.group(1)}.{fused}.{leaf}"
        out[full] = _fuse_leaf(full, [tensors[n] for n in names], spans)
        taken.update(names)
    return out


def _fuse_leaf(name: str, parts: list[torch.Tensor], spans) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    total = spans[-1][2]
    if leaf == "weight_shape":
        return torch.tensor([total, int(parts[0][1])], dtype=parts[0].dtype)
    if _rows_of_parts(leaf, tuple(parts[0].shape), total):
        fused = torch.cat([t.contiguous() for t in parts])
        if fused.shape[0] != total:  # packed along rows: each part must split back on whole words
            for _, lo, hi in spans:
                _word_rows(fused.shape[0], lo, hi, total, name)
        return fused
    if leaf in _MAX_LEAVES:
        return torch.stack(parts).amax(0)
    if any(not torch.equal(parts[0], t) for t in parts[1:]):
        raise QuantSpecError(f"{name}: the fused module's parts hold different values ({leaf}), which one "
                             "fused tensor cannot store")
    return parts[0]


def part_config(args, config):
    """`config` with every exact fused module name in its ignore list and its groups' targets
    replaced by its parts' names (what the quantizers, which work on the parts, match); the
    converse of `checkpoint_config`."""
    units = fused_units(args)

    def expand(names: tuple[str, ...], where: str) -> tuple[str, ...]:
        out: list[str] = []
        for n in names:
            m = _LAYER.match(n)
            spans = next((s for f, s in units if m and m.group(2) == f), None)
            out += [n] if spans is None else [f"{m.group(1)}.{p}" for p, _, _ in spans]
        return tuple(out)

    return _with_names(config, expand) if units else config


def _with_names(config, rename: Callable[[tuple[str, ...], str], tuple[str, ...]]):
    """`config` with its groups' targets and its ignore list each passed through `rename(names,
    what names them)`."""
    groups = {k: replace(s, targets=rename(tuple(s.targets), f"config group {k}"))
              for k, s in config.config_groups.items()}
    return replace(config, config_groups=groups, ignore=rename(tuple(config.ignore), "--ignore"))


def checkpoint_config(args, config):
    """`config` (a `QuantConfig` in the parts' module names) with every exact module name in its
    ignore list and its groups' targets renamed to the fused module's, a unit named whole or
    not at all; an exact fused module name stays as it is (the parts match it through
    `checkpoint_name`)."""
    units = fused_units(args)

    def rename(names: tuple[str, ...], where: str) -> tuple[str, ...]:
        out: list[str] = []
        for n in names:
            fused = checkpoint_name(args, n)
            if fused == n:
                out.append(n)
                continue
            layer = fused.rsplit(".", 2)[0]
            spans = next(s for f, s in units if fused.endswith("." + f))
            if any(f"{layer}.{p}" not in names for p, _, _ in spans):
                raise QuantSpecError(f"{where} names {n} without the rest of {fused}: a {args.arch} checkpoint "
                                     f"stores them as one module; name {fused} instead")
            if fused not in out:
                out.append(fused)
        return tuple(out)

    return _with_names(config, rename) if units else config


def layer_weight_table(args: ModelArgs, prefix: str, layer_idx: int = 0) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer `layer_idx` named `prefix` (e.g. "model.layers.3."), with shapes."""
    D, I, p = args.hidden_size, args.intermediate_size, prefix
    norms = ("input_layernorm",) * args.pre_norms + ("post_attention_layernorm",) + (
        ("post_feedforward_layernorm",) + ("pre_feedforward_layernorm",) * args.pre_norms if args.post_norms else ())
    table: dict[str, tuple[int, ...]] = {f"{p}{n}.weight": (D,) for n in norms}
    for name, out_f in (("q_proj", args.q_size), ("k_proj", args.kv_size), ("v_proj", args.kv_size)):
        table[p + f"self_attn.{name}.weight"] = (out_f, D)
        if args.qkv_bias:
            table[p + f"self_attn.{name}.bias"] = (out_f,)
    table[p + "self_attn.o_proj.weight"] = (D, args.q_size)
    if args.qk_norm:
        table[p + "self_attn.q_norm.weight"] = (args.head_dim if args.qk_norm_per_head else args.q_size,)
        table[p + "self_attn.k_norm.weight"] = (args.head_dim if args.qk_norm_per_head else args.kv_size,)
    if args.o_bias:
        table[p + "self_attn.o_proj.bias"] = (D,)
    mlps = [(p + "mlp.", I, ("gate_proj", "up_proj", "down_proj"))]
    if args.is_moe_layer(layer_idx):
        from quantspec.model_zoo.moe import moe_weight_table

        mlps = moe_weight_table(args, p, table)
    for m, inter, (gate, up, down) in mlps:
        for name, shape in ((gate, (inter, D)), (up, (inter, D)), (down, (D, inter))):
            table[f"{m}{name}.weight"] = shape
            if args.mlp_bias:
                table[f"{m}{name}.bias"] = shape[:1]
    return table


def hf_weight_table(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this architecture must hold, with its shape.

    Loading asserts the checkpoint against this table (missing, unexpected, mis-shaped names are
    one clear error) instead of trusting `load_state_dict` to say something useful.
    """
    D, V = args.hidden_size, args.vocab_size
    table: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(args.num_layers):
        table.update(layer_weight_table(args, f"model.layers.{i}.", i))
    if not args.tie_word_embeddings:
        table["lm_head.weight"] = (V, D)
    return table
