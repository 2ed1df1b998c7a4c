"""Rotations fused into a decoder's weights before it is quantized (SpinQuant's R1 and R2, the
offline rotations of QuaRot), and the compressed-tensors `transform_config` that records them.

R1 turns the residual stream by one orthogonal matrix R [D, D]: every Linear that writes it
(`o_proj`, each MLP's `down_proj`, the embedding) has its output rows taken to R's basis, every
Linear that reads it (q / k / v, gate / up, a router, the output head) its input columns. RMSNorm
commutes with an orthogonal turn only without its per-channel weight, so each norm's weight is
folded first into the Linears that read it and set to ones. R2 turns each attention head's values
by R2 [hd, hd]: `v_proj`'s rows per KV head and `o_proj`'s columns per head. The model computes
the same function (up to rounding); what changes is the basis the quantizers see: outlier channels
of the residual stream and the values are spread over all channels, so per-tensor and per-token
activation scales and GPTQ's error compensation lose less (the measured effect, per recipe, is in
docs/benchmarks.md, `bench/rotate.py`).

R1 and R2 are random Hadamard matrices (a Hadamard matrix of the size, from compressed-tensors'
`random_hadamard_matrix`, with each row's sign drawn from `seed`, scaled to be orthogonal),
computed and applied in float64. A model whose norm weights cannot be folded this way (Gemma's
and OLMo 2's norms of each block's output, added to the residual as they are) is refused.

The artifact records the rotations as llm-compressor's SpinQuant writes them: a `transform_config`
whose every transform is fused into the weights (`weight_input` / `weight_output`), which vLLM
validates and runs as the plain Linears they are, and which SGLang and transformers do not read
(nothing is left for them to run). `config.json` also keeps `quantspec_rotation` (the rotations
and their seed), because two seeds give different weights under the same `transform_config`, and
a draft head trained on one base's hidden states reads another's wrong.

SpinQuant's R4 turns each `down_proj`'s input at run time; `--rotate` takes it beside R1 / R2
(`split_rotate`), and it is written as a run-time transform (`calib.quip`, `Quip.r4`): it changes
no hidden state, so it is not part of `quantspec_rotation`. A table calibrated with R4 records it
(`run_time_rotation`): its down_proj input ranges are of the turned inputs, so static input scales
and SmoothQuant read such a table only for a run that turns them too (`check_table_rotation`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import CheckpointReader
from quantspec.model_zoo.hf_config import ROTATION_KEY, TRANSFORM_TYPE, rotation_tag
from quantspec.quant.decompressed import float_nbytes, source_quantization

__all__ = ["ROTATIONS", "ROTATION_KEY", "Rotation", "RotatedReader", "check_table_rotation", "layer_targets",
           "rotated_config", "rotation_tag", "split_rotate"]

ROTATIONS = ("R1", "R2")
RUN_TIME_ROTATION = "R4"  # SpinQuant's online rotation of down_proj's input (`calib.quip`)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Rotation:
    """Which rotations (`ROTATIONS`, in that order) and the seed of their signs."""

    rotations: tuple[str, ...]
    seed: int = 0

    @classmethod
    def parse(cls, spec: str | None, seed: int = 0) -> "Rotation | None":
        """`--rotate` ("R1", "R1,R2", "none" / None → None), one line naming the flag otherwise."""
        if spec is None or str(spec).strip().lower() in ("", "none"):
            return None
        names = [s.strip().upper() for s in str(spec).split(",") if s.strip()]
        bad = [n for n in names if n not in ROTATIONS]
        if bad or not names or len(set(names)) != len(names):
            raise QuantSpecError(f"--rotate {spec!r}: use R1 or R1,R2 (rotations fused into the weights), R4 "
                                 "(down_proj's inputs at run time; alone or after them), or none")
        if "R1" not in names:
            raise QuantSpecError(f"--rotate {spec!r}: R2 turns the values inside attention and goes with R1; "
                                 "use --rotate R1,R2")
        return cls(tuple(n for n in ROTATIONS if n in names), int(seed))

    @classmethod
    def from_meta(cls, meta: Mapping | None) -> "Rotation | None":
        """The rotation a `to_meta()` dict (config.json's `quantspec_rotation`, a table's) names."""
        if not meta:
            return None
        return cls(tuple(meta.get("rotations") or ()), int(meta.get("seed", 0)))

    def to_meta(self) -> dict:
        return {"rotations": list(self.rotations), "type": TRANSFORM_TYPE, "seed": self.seed}

    def matrix(self, which: str, size: int) -> torch.Tensor:
        """R1 [D, D] or R2 [hd, hd], orthogonal, float64."""
        from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

        gen = torch.Generator().manual_seed(self.seed + ROTATIONS.index(which))
        try:
            h = random_hadamard_matrix(size, torch.float64, gen=gen)
        except ValueError:
            raise QuantSpecError(f"--rotate {which}: no Hadamard matrix of size {size} is known here (sizes k·2^m "
                                 "with k a multiple of 4 up to 256); quantize without --rotate") from None
        return h / math.sqrt(size)

    def transform_config(self, model) -> dict:
        """The `transform_config` (compressed-tensors' own classes, dumped) recording these
        rotations of `model` (a quantspec Transformer, its modules named as the checkpoint's parts)."""
        from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

        roles = _roles(model)
        groups = {"R1": TransformScheme(type=TRANSFORM_TYPE, precision=torch.float64, apply=[
            TransformArgs(targets=layer_targets(roles["writes"]), location="weight_output"),
            TransformArgs(targets=layer_targets(roles["reads"]), location="weight_input", inverse=True)])}
        if "R2" in self.rotations:
            groups["R2"] = TransformScheme(type=TRANSFORM_TYPE, precision=torch.float64, head_dim=model.args.head_dim,
                                           apply=[TransformArgs(targets=layer_targets(roles["values"]),
                                                                location="weight_output"),
                                                  TransformArgs(targets=layer_targets(roles["heads"]),
                                                                location="weight_input", inverse=True)])
        return json.loads(json.dumps(TransformConfig(config_groups=groups).model_dump()))


def split_rotate(spec: str | None) -> tuple[str | None, bool]:
    """`quantize --rotate` as (its fused rotations, for `Rotation.parse`; whether it asks for R4)."""
    names = [s.strip() for s in str(spec or "").split(",") if s.strip()]
    rest = [n for n in names if n.upper() != RUN_TIME_ROTATION]
    if len(rest) == len(names):
        return spec, False
    if len(names) - len(rest) > 1:
        raise QuantSpecError(f"--rotate {spec!r} names R4 twice; use e.g. R1,R2,R4")
    return (",".join(rest) or None), True


def rotated_config(rotation: "Rotation | None", cfg: dict, draft: str | None = None) -> dict:
    """The source's config.json as the rotated model's (untied, `quantspec_rotation` recorded);
    `cfg` itself without `rotation`. Refused for a draft module (`draft`: "X is an EAGLE-3 head")
    or a source already rotated."""
    if rotation is None:
        return cfg
    if draft:
        raise QuantSpecError(f"--rotate turns a base model's residual stream, and {draft}; quantize the head "
                             "without --rotate (train it on the rotated base)")
    if tag := rotation_tag(cfg):
        raise QuantSpecError(f"the model already has rotations fused into its weights ({tag}); drop --rotate")
    return {**cfg, "tie_word_embeddings": False, ROTATION_KEY: rotation.to_meta()}


def check_table_rotation(rotation: "Rotation | None", calib, table, r4: bool = False, ranges: bool = True) -> None:
    """Refuse a calibration table (at `calib`) measured with other fused rotations than `rotation`
    or, where its input ranges are read (`ranges`), with R4 where the run (`r4`: whether it turns
    down_proj's inputs) has none or the reverse: its down_proj ranges are another basis's."""
    have = Rotation.from_meta(table.meta.get("rotation"))
    had_r4 = bool(table.meta.get("run_time_rotation"))
    if have != rotation or (ranges and r4 != had_r4):
        raise QuantSpecError(f"{calib} was calibrated {_with_rotate(have, had_r4)}, and this run quantizes "
                             f"{_with_rotate(rotation, r4)}: its scales are another model's; calibrate "
                             f"{_with_rotate(rotation, r4)}")


def _with_rotate(rotation: "Rotation | None", r4: bool) -> str:
    names = [*(rotation.rotations if rotation else ()), *([RUN_TIME_ROTATION] if r4 else [])]
    if not names:
        return "without --rotate"
    return f"with --rotate {','.join(names)}" + (f" --seed {rotation.seed}" if rotation else "")


# ---- which Linears a rotation touches -------------------------------------------------------
def _roles(model) -> dict[str, list[str]]:
    """Module names (the checkpoint's parts') by role: `reads` the residual stream (after a norm,
    whose weight is `norm_of[...]`), `writes` it, `values` (v_proj) and `heads` (o_proj) for R2;
    refused where a norm's weight cannot be folded."""
    from quantspec.calib.smooth import layer_mlps, layer_norm_groups

    args = model.args
    if args.post_norms or not args.pre_norms or args.norm_unit_offset:
        raise QuantSpecError(f"--rotate: a {args.arch} model normalizes each block's output before adding it to the "
                             "residual stream, so no rotation of the stream folds into its weights; quantize it "
                             "without --rotate")
    roles: dict[str, Any] = {"reads": ["lm_head"], "writes": ["model.embed_tokens"], "values": [], "heads": [],
                             "norm_of": {"lm_head": "model.norm"}}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        for norm, readers in layer_norm_groups(layer):
            for r in readers:
                roles["reads"].append(f"{p}.{r}")
                roles["norm_of"][f"{p}.{r}"] = f"{p}.{norm}"
        roles["writes"] += [f"{p}.self_attn.o_proj"] + [f"{p}.{down}" for _, down in layer_mlps(layer)]
        roles["values"].append(f"{p}.self_attn.v_proj")
        roles["heads"].append(f"{p}.self_attn.o_proj")
    return roles


def layer_targets(names: Iterable[str]) -> list[str]:
    """`names` as compressed-tensors targets: each decoder-layer name as a regex over every layer
    (`re:.*self_attn\\.o_proj$`), the rest as they are."""
    out: list[str] = []
    for n in names:
        m = _LAYER.match(n)
        t = n if m is None else "re:.*" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p)
                                                    for p in m.group(2).split(".")) + "$"
        if t not in out:
            out.append(t)
    return out


# ---- the rotated checkpoint ------------------------------------------------------------------
class RotatedReader(CheckpointReader):
    """`inner` (a `CheckpointReader`, or a quantized checkpoint's `DecompressedReader`) read as the
    checkpoint of the rotated model: the same names and shapes, plus `lm_head.weight` where the
    embedding was tied (a rotated head folds the final norm's weight, the embedding does not, so
    they part); every norm that a rotation crosses reads as ones. Rotated tensors are computed in
    float64 on each read, on the device it is read to (a layer quantized on CUDA turns there), and
    returned in the checkpoint's dtype (or `dtype`); only the tensors no rotation touches keep their
    `ranges` (copied as stored)."""

    def __init__(self, inner: CheckpointReader, model, rotation: Rotation):
        self.inner, self.rotation, self.model_dir = inner, rotation, inner.model_dir
        self.stored, self.splits = inner.stored, {}
        self.source_quantization = source_quantization(inner)  # a quantized source's provenance, kept
        args = model.args
        roles = _roles(model)
        self.norm_of: dict[str, str] = roles["norm_of"]
        self.ops: dict[str, tuple[str, str]] = {}  # tensor → (op, module)
        for m in roles["reads"]:
            self.ops[f"{m}.weight"] = ("read", m)
        for m in roles["writes"]:
            self.ops[f"{m}.weight"] = ("embed" if m == "model.embed_tokens" else "write", m)
            self.ops[f"{m}.bias"] = ("write_bias", m)
        if "R2" in rotation.rotations:
            for m in roles["values"]:
                self.ops[f"{m}.bias"] = ("value_bias", m)
        self.values, self.heads = set(roles["values"]), set(roles["heads"])
        self.tied = HEAD not in inner.shapes  # the source ties its head to the embedding
        self.shapes = dict(inner.shapes)
        if self.tied:
            self.shapes[HEAD] = self.shapes[EMBED]
        for norm in set(self.norm_of.values()):
            self.ops[f"{norm}.weight"] = ("ones", norm)
        self.ops = {n: op for n, op in self.ops.items() if n in self.shapes}
        self.ranges = {n: r for n, r in inner.ranges.items() if n in self.shapes and n not in self.ops}
        self.R1 = rotation.matrix("R1", args.hidden_size)
        self.R2 = rotation.matrix("R2", args.head_dim) if "R2" in rotation.rotations else None
        self.kv_heads, self.heads_n, self.head_dim = args.num_kv_heads, args.num_heads, args.head_dim
        self._norms: dict[str, torch.Tensor] = {}
        self._matrices: dict[torch.device, tuple] = {}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return float_nbytes(self, self.shapes if names is None else names)

    def _norm(self, module: str) -> torch.Tensor:
        norm = self.norm_of[module]
        if norm not in self._norms:
            self._norms[norm] = self.inner.read([f"{norm}.weight"], dtype=torch.float64)[f"{norm}.weight"]
        return self._norms[norm]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(R1, R2) on `device` (where the tensor being read is: a layer quantized on CUDA turns there)."""
        if device not in self._matrices:
            self._matrices[device] = (self.R1.to(device), None if self.R2 is None else self.R2.to(device))
        return self._matrices[device]

    def _rotate(self, name: str, t: torch.Tensor) -> torch.Tensor:
        op, module = self.ops[name]
        w = t.to(torch.float64)
        R1, R2 = self._on(w.device)
        if op == "ones":
            return torch.ones_like(w)
        if op == "read":
            w = (w * self._norm(module).to(w.device)) @ R1
            if module in self.values and R2 is not None:  # rows per KV head into R2's basis
                w = (R2.T @ w.view(self.kv_heads, self.head_dim, -1)).reshape(w.shape)
            return w
        if op == "embed":
            return w @ R1
        if op == "write":
            if module in self.heads and R2 is not None:  # columns per head: the values' basis
                w = (w.view(w.shape[0], self.heads_n, self.head_dim) @ R2).reshape(w.shape)
            return R1.T @ w
        if op == "write_bias":
            return w @ R1
        return (w.view(self.kv_heads, self.head_dim) @ R2).reshape(w.shape)  # value_bias

    def read(self, names: list[str], *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            src = EMBED if n == HEAD and self.tied else n
            if n not in self.shapes:
                raise QuantSpecError(f"{self.model_dir} lacks {n}; the checkpoint is incomplete")
            t = self.inner.read([src], device=device)[src]
            if n in self.ops:
                t = self._rotate(n, t).to(t.dtype)
            out[n] = t.to(device=device, dtype=dtype or t.dtype)
        return out

    def rows(self, name: str, ids: torch.Tensor, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> torch.Tensor:
        if name not in self.ops:
            return self.inner.rows(name, ids, dtype=dtype, device=device)
        x = self.inner.rows(name, ids)
        return (x.to(torch.float64) @ self.R1).to(device=device, dtype=dtype or x.dtype)
