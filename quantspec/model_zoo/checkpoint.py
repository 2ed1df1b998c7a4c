"""Finding and reading checkpoints: zoo name / local HF directory / hub id → a directory;
single-file or sharded safetensors → tensors, with one-line errors for what users get wrong.

Two ways to read the weights: `load_model` reads the whole checkpoint into a `Transformer`;
`CheckpointReader` reads it one module at a time (each tensor read from its file and converted a
block at a time), so a model larger than memory is quantized or calibrated one layer at a time.

Never builds transformers' modeling classes: architectures and weight-name tables are `llama.py`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.hf_config import modelopt_sidecar
from quantspec.model_zoo.layout import FUSED, ShapedTensors, part_shape, part_tensor, split_plan
from quantspec.model_zoo.llama import ARCHITECTURES, ModelArgs, Transformer, hf_weight_table
from quantspec.model_zoo.multimodal import stored_names, text_decoder_config
from quantspec.model_zoo.safetensors_io import (FILE_DTYPES, FLOAT_DTYPES, FileRange, read_file_range,
                                                reading_safetensors, safetensors_header, safetensors_keys)

__all__ = ["build_model", "check_checkpoint", "checkpoint_float_dtype", "CheckpointReader", "CheckpointTensors",
           "draft_kind", "FileRange", "load_checkpoint_tensors", "load_model", "model_fingerprint", "read_config",
           "reading_safetensors", "release_free_heap", "resident", "resolve_model_dir", "safetensors_files",
           "safetensors_header", "safetensors_keys", "save_module", "verify_checkpoint"]

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # tensors some HF checkpoints carry that are recomputed here


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """A zoo name (`smollm2-135m`), a local HF directory, or a hub id (downloaded when online)."""
    from quantspec.model_zoo import default

    name = str(model)
    if name in default.ZOO:
        return default.ensure_zoo_model(name)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantSpecError(f"{path} is a file; pass the model directory that holds config.json")
        if not (path / "config.json").exists():
            raise QuantSpecError(f"{path} has no config.json; pass a HF model directory or a quantspec artifact")
        return path
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise QuantSpecError(
            f"model path {name} does not exist; pass a local HF directory, a hub id, or one of: "
            f"{', '.join(default.ZOO)}"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        ))
    except Exception as e:  # offline, gated, or a typo — all surface as one line
        raise QuantSpecError(f"could not fetch {name!r} from the hub ({type(e).__name__}); download it first "
                             "and pass the local directory") from None


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:  # (a multimodal checkpoint's: the text decoder's, `multimodal.py`; an older ModelOpt export's sidecar)
        cfg = json.loads(path.read_text())
        return modelopt_sidecar(model_dir, text_decoder_config(cfg) or cfg)
    except FileNotFoundError:
        raise QuantSpecError(f"{model_dir} has no config.json; pass a HF model directory") from None
    except json.JSONDecodeError as e:
        raise QuantSpecError(f"{path} is not valid JSON (line {e.lineno}); repair or re-create it") from None


def draft_kind(cfg: dict) -> str | None:
    """"mtp" / "medusa" / "eagle3" when a config.json is a draft module's (an MTP module, Medusa
    heads, an EAGLE-3 head), else None: a causal LM."""
    from quantspec.model_zoo.eagle3 import is_eagle3_config
    from quantspec.model_zoo.medusa import is_medusa_config
    from quantspec.model_zoo.mtp import is_mtp_config
    from quantspec.model_zoo.speculators import eagle3_config, is_speculators_config

    for kind, is_it in (("mtp", is_mtp_config), ("medusa", is_medusa_config), ("eagle3", is_eagle3_config)):
        if is_it(cfg):
            return kind
    if is_speculators_config(cfg):
        eagle3_config(cfg)  # a speculators model of another algorithm: its one-line refusal
    return None


def safetensors_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_dir / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise QuantSpecError(f"{index} is corrupt (no weight_map); re-download or re-create it") from None
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise QuantSpecError(
                f"{index.name} names shard(s) that are missing: {', '.join(missing)}; re-download the checkpoint"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise QuantSpecError(
                f"{model_dir} holds only PyTorch pickle weights; convert them to safetensors "
                f"(transformers: save_pretrained(safe_serialization=True))"
            )
        raise QuantSpecError(f"{model_dir} has no *.safetensors weights")
    return files


def verify_checkpoint(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, each checked from its header: a missing shard or a
    truncated or corrupt file is refused before any work starts."""
    files = safetensors_files(model_dir)
    for f in files:
        safetensors_keys(f)
    return files


def load_checkpoint_tensors(model_dir: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        with reading_safetensors(f):
            tensors.update(load_file(str(f), device=str(device)))
    return tensors


def build_model(args: ModelArgs, device: str | torch.device = "meta") -> Transformer:
    with torch.device(device):
        return Transformer(args)


def check_against_table(tensors: Mapping[str, Any], table: dict[str, tuple[int, ...]], where: str) -> None:
    """Every name of `table` is in `tensors` (name → tensor, or name → shape) with its shape."""
    missing = [n for n in table if n not in tensors]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise QuantSpecError(f"{where} lacks {', '.join(missing[:3])}{more}; the checkpoint is incomplete")
    for name, shape in table.items():
        have = tuple(getattr(tensors[name], "shape", tensors[name]))
        if have != shape:
            raise QuantSpecError(f"{where}: {name} has shape {have}, config.json implies {shape}")


def check_exactly_table(tensors: Mapping[str, Any], table: dict[str, tuple[int, ...]], where: str, what: str) -> None:
    """`check_against_table`, and no tensor beyond the table (`what` names the module kind)."""
    check_against_table(tensors, table, where)
    unexpected = sorted(set(tensors) - set(table))
    if unexpected:
        raise QuantSpecError(f"{where}: unexpected tensor {unexpected[0]} for {what}")


def check_checkpoint(tensors: Mapping[str, Any], args: ModelArgs, where: str) -> list[str]:
    """Check a checkpoint's tensors (name → tensor, or name → shape) against the HF weight table
    of `args`; returns the names to load (recomputed ones — rotary tables — and a tied head's
    copy left out)."""
    names = [k for k in tensors if not k.endswith(_IGNORED_SUFFIXES)]
    if args.tie_word_embeddings:
        names = [k for k in names if k != "lm_head.weight"]  # some exporters write the tied copy anyway
    table = hf_weight_table(args)
    check_against_table(tensors, table, where)
    unexpected = sorted(set(names) - set(table))
    if unexpected:
        raise QuantSpecError(f"{where}: unexpected tensor {unexpected[0]} for a {args.arch} checkpoint")
    return names


def load_model(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Transformer, Path]:
    """Load an unquantized HF checkpoint (single-file or sharded) into our `Transformer`, built on
    `meta` and filled with `assign=True` one tensor at a time, each in `dtype`: peak memory is the
    model in `dtype` plus one checkpoint tensor."""
    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    if cfg.get("quantization_config"):
        raise QuantSpecError(
            f"{model_dir} is a quantized artifact; load it with quantspec.infer.loader.load_for_inference"
        )
    args = ModelArgs.from_hf_config(cfg)
    reader = CheckpointReader(model_dir)
    names = check_checkpoint(reader.shapes, args, str(model_dir))
    # one tensor read (and converted) at a time: the model's own tensors are the only full copy
    tensors = {k: reader.read([k], dtype=dtype)[k] for k in names}
    net = build_model(args)
    net.load_state_dict(tensors, strict=False, assign=True)
    if args.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.to(device)
    net.setup_rope(args.max_position_embeddings, device)
    return net.eval(), model_dir


# ---------------------------------------------------------------------------------------------
# one module at a time

# the embedding rows a calibration batch needs are gathered from blocks of this many bytes
_ROW_BLOCK_BYTES = 64 * 2**20


def checkpoint_float_dtype(model_dir: str | os.PathLike) -> torch.dtype | None:
    """The dtype every floating tensor of the checkpoint is stored in, from its headers (None: they
    differ, or there is none)."""
    kinds = {r.dtype for r in CheckpointReader(model_dir).ranges.values() if r.dtype in FLOAT_DTYPES}
    return FLOAT_DTYPES[kinds.pop()] if len(kinds) == 1 else None


class CheckpointReader:
    """A safetensors checkpoint read one module at a time.

    The headers are read once (`verify_checkpoint`: a missing shard or a truncated file fails here,
    before any work). `read(names)` reads each tensor with plain file reads (`read_file_range`,
    converted to `dtype` a block at a time; a dtype it does not know through safetensors' own
    mapping, one tensor at a time), so what stays resident is only what the caller keeps.
    `load(module, prefix)` materialises a module built on `meta` (`assign=True`); `release(module)`
    returns it to `meta`; `ranges[name]` says where a tensor's bytes lie, to copy them as they are.
    A checkpoint whose config.json fuses modules (Phi-3's `qkv_proj`, `layout.py`) is read under its
    parts' names (rows cut from the fused tensor, which `ranges` alone names); a multimodal one's
    text decoder under a text model's names (`multimodal.py`; `stored`: those names' in the files).
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.ranges: dict[str, FileRange] = {}
        for f in verify_checkpoint(self.model_dir):
            start, header = safetensors_header(f)
            for name, e in header.items():
                if name != "__metadata__":
                    b, end = e["data_offsets"]
                    self.ranges[name] = FileRange(f, start + b, end - b, e["dtype"], tuple(e["shape"]))
        self.stored = stored_names(cfg := _raw_config(self.model_dir), self.ranges) or {}  # multimodal: the decoder's
        self.ranges = {n: self.ranges[s] for n, s in self.stored.items()} if self.stored else self.ranges
        self.splits = _split_plan(cfg, self.ranges)
        fused = {src for src, _, _, _ in self.splits.values()}
        self.shapes = {n: r.shape for n, r in self.ranges.items() if n not in fused}
        for name, (src, lo, hi, total) in self.splits.items():
            self.shapes[name] = part_shape(src, self.ranges[src].shape, lo, hi, total)

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """The bytes `names` (default: every tensor) take in the checkpoint."""
        return sum(self.ranges[n].nbytes for n in (self.ranges if names is None else names))

    def _files_of(self, names: list[str]) -> dict[Path, list[str]]:
        missing = [n for n in names if n not in self.ranges]
        if missing:
            raise QuantSpecError(f"{self.model_dir} lacks {missing[0]}; the checkpoint is incomplete")
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.ranges[n].path, []).append(n)
        return by_file

    def read(self, names: list[str], *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """{name: tensor} for `names`, converted to `dtype` (default: the checkpoint's) on `device`;
        each tensor owns its memory, read with plain file reads (`read_file_range`: no file
        mapping doubles a large tensor while it is copied)."""
        from safetensors import safe_open

        names = list(names)
        parts = [n for n in names if n in self.splits]
        out = {}
        if parts:
            whole = self.read(sorted({self.splits[n][0] for n in parts}), dtype=dtype, device=device)
            for n in parts:
                src, lo, hi, total = self.splits[n]
                out[n] = part_tensor(src, whole[src], lo, hi, total)
            del whole
            names = [n for n in names if n not in self.splits]
        for f, ns in self._files_of(names).items():
            for n in ns:
                r = self.ranges[n]
                if r.dtype in FILE_DTYPES:
                    with reading_safetensors(f):
                        t = read_file_range(r, dtype if torch.device(device).type == "cpu" else None)
                    out[n] = t.to(device=device, dtype=dtype or t.dtype)
                    continue
                with reading_safetensors(f), safe_open(str(f), framework="pt") as h:  # one tensor mapped
                    t = h.get_tensor(self.stored.get(n, n))  # a view of the mapped file
                    out[n] = t.to(device=device, dtype=dtype or t.dtype, copy=True)
                    del t
        return {n: out[n] for n in [*parts, *names]}

    def rows(self, name: str, ids: torch.Tensor, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> torch.Tensor:
        """The rows `ids` [...] of the 2-D tensor `name` [V, D] → [..., D] (an embedding lookup),
        read in blocks of rows so the whole tensor is never resident."""
        from safetensors import safe_open

        (f,) = self._files_of([name])
        V, D = self.shapes[name]
        flat = ids.reshape(-1).cpu()
        out = None
        step = max(1, _ROW_BLOCK_BYTES // max(1, self.ranges[name].nbytes // V))
        with reading_safetensors(f), safe_open(str(f), framework="pt") as h:
            sl = h.get_slice(self.stored.get(name, name))
            for a in range(0, V, step):
                sel = (flat >= a) & (flat < a + step)
                if bool(sel.any()):
                    block = sl[a:a + step]  # [≤ step, D]
                    if out is None:
                        out = torch.empty(flat.numel(), D, dtype=dtype or block.dtype)
                    out[sel] = block[flat[sel] - a].to(out.dtype)
        if out is None:  # no ids at all
            out = torch.empty(0, D, dtype=dtype)
        return out.view(*ids.shape, D).to(device)

    def load(self, module: torch.nn.Module, prefix: str, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu", rename: Mapping[str, str] | None = None) -> None:
        """Materialise `module` (parameters named `{prefix}.{key}` in the checkpoint; `rename`
        maps a key to another checkpoint name, e.g. a tied head to the embedding)."""
        rename = dict(rename or {})
        keys = list(module.state_dict())
        names = {k: rename.get(k, f"{prefix}.{k}" if prefix else k) for k in keys}
        want = {names[k]: tuple(v.shape) for k, v in module.state_dict().items()}
        check_against_table(self.shapes, want, str(self.model_dir))
        tensors = self.read(list(names.values()), dtype=dtype, device=device)
        module.load_state_dict({k: tensors[names[k]] for k in keys}, assign=True, strict=True)

    @staticmethod
    def release(module: torch.nn.Module) -> None:
        """Return `module`'s parameters to the `meta` device (frees them)."""
        module.to_empty(device="meta")


class CheckpointTensors(ShapedTensors):
    """A checkpoint's tensors as a read-only mapping that reads a tensor when it is looked up
    (`CheckpointReader.read`: a copy that owns its memory), so a loader
    that converts tensor by tensor holds what it keeps, never a second copy of the checkpoint.
    `shapes`: name → shape from the headers, for checks that need no data. A fused checkpoint's
    part is cut from its fused tensor, the last of which is kept, so looking up a unit's parts one
    after another reads it once."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.shapes = reader, reader.shapes
        self._fused: tuple[str, torch.Tensor] | None = None  # (name, tensor) of the last fused tensor read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if name not in self.reader.splits:
            return self.reader.read([name])[name]
        src, lo, hi, total = self.reader.splits[name]
        if self._fused is None or self._fused[0] != src:
            self._fused = None  # the previous unit's tensor is freed before the next is read
            self._fused = (src, self.reader.read([src])[src])
        return part_tensor(src, self._fused[1], lo, hi, total)


def _raw_config(model_dir: Path) -> dict:
    """config.json as on disk; {} where missing or not JSON (`read_config` names the problem)."""
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _split_plan(cfg: dict, names) -> dict:
    """`layout.split_plan` for a checkpoint of config.json `cfg` (none unless its architecture fuses)."""
    if not any(ARCHITECTURES.get(a) in FUSED for a in cfg.get("architectures") or ()):
        return {}
    return split_plan(ModelArgs.from_hf_config(cfg), names)


@contextlib.contextmanager
def resident(module: torch.nn.Module, prefix: str, weights: CheckpointReader | None, *,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             rename: Mapping[str, str] | None = None) -> Iterator[torch.nn.Module]:
    """`module` materialised inside the block: read from `weights` (and returned to `meta` after
    the block) when it is on the `meta` device, else as it is."""
    if all(p.device.type != "meta" for p in module.parameters()):
        yield module
        return
    if weights is None:
        raise QuantSpecError(f"{prefix} is on the meta device and no checkpoint is given to read it from")
    weights.load(module, prefix, dtype=dtype, device=device, rename=rename)
    try:
        yield module
    finally:
        weights.release(module)
        release_free_heap()


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`; a no-op elsewhere). A
    module read, used and freed after another leaves free pages between live allocations, which
    glibc keeps: without it, resident memory grows with the number of layers streamed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------
# fingerprints: `"<arch>-<weights>"`, 16 hex digits of a sha256 over config.json's architecture
# fields and 16 of a sha256 over the bytes of a few small weight tensors (every 1-D tensor — norms,
# biases — plus layer 0's `k_proj.weight`, or its fused `qkv_proj.weight`), so two models of the
# same shape but different weights differ. A quantized artifact's weights are not its source's, so
# its fingerprint is the source model's, read from its `quantspec.json` provenance
# (`model_fingerprint`).

# config.json fields that define the architecture
_ARCH_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "attention_bias", "mlp_bias")


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# ... and those of a mixture of experts (hashed where present: a dense model's hash is unchanged)
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


# ... and the per-layer rotary layouts (hashed where present)
_ROPE_FIELDS = ("no_rope_layers", "partial_rotary_factor", "original_max_position_embeddings")


def _arch_hash(cfg: Mapping[str, Any]) -> str:
    arch = {k: cfg.get(k) for k in _ARCH_FIELDS} | {k: cfg[k] for k in (*_MOE_FIELDS, *_ROPE_FIELDS) if k in cfg}
    return _sha16(json.dumps(arch, sort_keys=True, default=str).encode())


# the 2-D weights hashed beside every 1-D tensor: layer 0's k_proj (the q/k/v of a fused checkpoint)
_HASHED_WEIGHTS = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight")


def _weights_hash(model_dir: Path) -> str:
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                sl = st.get_slice(name)
                shape = sl.get_shape()
                if len(shape) == 1 or name in _HASHED_WEIGHTS:
                    t = st.get_tensor(name).contiguous()
                    h.update(name.encode())
                    h.update(str(t.dtype).encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """`"<arch16>-<weights16>"` for a HF model directory (see above).

    For a quantized artifact: the source model's fingerprint from its provenance if recorded,
    else `"<arch16>-"` (architecture only).
    """
    d = resolve_model_dir(model_dir)
    cfg = read_config(d)
    if cfg.get("quantization_config"):
        prov = d / "quantspec.json"
        if prov.is_file():
            try:
                meta = json.loads(prov.read_text())
            except json.JSONDecodeError:
                meta = {}
            fp = (meta.get("provenance") or {}).get("model_fingerprint") or \
                meta.get("model_fingerprint")
            if isinstance(fp, str) and fp:
                return fp
        return f"{_arch_hash(cfg)}-"
    return f"{_arch_hash(cfg)}-{_weights_hash(d)}"


def save_module(module: torch.nn.Module, out_dir: str | os.PathLike, config: dict,
                extra_config: dict | None = None) -> Path:
    """Write `config` (`extra_config` merged into its "quantspec" section) as config.json and the
    module's state dict as model.safetensors into `out_dir`, each file replaced atomically (a
    draft module's artifact)."""
    from safetensors.torch import save_file

    from quantspec.outputs import atomic_file, write_text

    if extra_config:
        config = {**config, "quantspec": {**config.get("quantspec", {}), **extra_config}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    with atomic_file(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out
