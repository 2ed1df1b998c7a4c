"""Finding and reading checkpoints: zoo name / local HF directory / hub id → a directory;
single-file or sharded safetensors → tensors, with one-line errors for what users get wrong.

Never builds transformers' modeling classes: architectures come from `llama.py` and weights are
checked against its HF weight-name table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from quantspec.errors import QuantSpecError
from quantspec.model_zoo.llama import ModelArgs, Transformer, hf_weight_table

__all__ = [
    "save_module",
    "build_model",
    "load_checkpoint_tensors",
    "load_model",
    "model_fingerprint",
    "read_config",
    "reading_safetensors",
    "resolve_model_dir",
    "safetensors_files",
    "safetensors_keys",
    "verify_checkpoint",
]

# Tensors some HF checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
        raise QuantSpecError(
            f"could not fetch {name!r} from the hub ({type(e).__name__}); download it first and pass "
            f"the local directory"
        ) from None


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise QuantSpecError(f"{model_dir} has no config.json; pass a HF model directory") from None
    except json.JSONDecodeError as e:
        raise QuantSpecError(f"{path} is not valid JSON (line {e.lineno}); repair or re-create it") from None


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


@contextlib.contextmanager
def reading_safetensors(f: str | os.PathLike) -> Iterator[None]:
    """Read the safetensors file `f` inside the block: a missing, truncated or corrupt file is one
    line naming it."""
    from safetensors import SafetensorError

    f = Path(f)
    if not f.is_file():
        raise QuantSpecError(f"{f} is missing; re-download or re-create it")
    try:
        yield
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise QuantSpecError(f"{f} is truncated or corrupt ({reason}); re-download or re-create it") from None


def safetensors_keys(f: str | os.PathLike) -> list[str]:
    """The tensor names of one safetensors file, from its header (the file must cover every
    tensor the header lists: a truncated file is refused without reading its data)."""
    from safetensors import safe_open

    with reading_safetensors(f), safe_open(str(f), framework="pt") as h:
        return list(h.keys())


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


def check_against_table(tensors: dict[str, torch.Tensor], table: dict[str, tuple[int, ...]], where: str) -> None:
    missing = [n for n in table if n not in tensors]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise QuantSpecError(f"{where} lacks {', '.join(missing[:3])}{more}; the checkpoint is incomplete")
    for name, shape in table.items():
        if tuple(tensors[name].shape) != shape:
            raise QuantSpecError(
                f"{where}: {name} has shape {tuple(tensors[name].shape)}, config.json implies {shape}"
            )


def load_model(model: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Transformer, Path]:
    """Load an unquantized HF checkpoint into our `Transformer` (built on meta, `assign=True`)."""
    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    if cfg.get("quantization_config"):
        raise QuantSpecError(
            f"{model_dir} is a quantized artifact; load it with quantspec.infer.loader.load_for_inference"
        )
    args = ModelArgs.from_hf_config(cfg)
    tensors = load_checkpoint_tensors(model_dir)
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if args.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy anyway
    table = hf_weight_table(args)
    check_against_table(tensors, table, str(model_dir))
    unexpected = sorted(set(tensors) - set(table))
    if unexpected:
        raise QuantSpecError(f"{model_dir}: unexpected tensor {unexpected[0]} for a {args.arch} checkpoint")
    net = build_model(args)
    net.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.to(device)
    net.setup_rope(args.max_position_embeddings, device)
    return net.eval(), model_dir


# ---------------------------------------------------------------------------------------------
# fingerprints: `"<arch>-<weights>"`, 16 hex digits of a sha256 over config.json's architecture
# fields and 16 of a sha256 over the bytes of a few small weight tensors (every 1-D tensor — norms,
# biases — plus layer 0's `k_proj.weight`), so two models of the same shape but different weights
# differ. A quantized artifact's weights are not its source's, so its fingerprint is the source
# model's, read from its `quantspec.json` provenance (`model_fingerprint`).

# config.json fields that define the architecture
_ARCH_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta",
                "rope_parameters", "rope_scaling", "attention_bias", "mlp_bias")


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _arch_hash(cfg: Mapping[str, Any]) -> str:
    arch = {k: cfg.get(k) for k in _ARCH_FIELDS}
    return _sha16(json.dumps(arch, sort_keys=True, default=str).encode())


def _weights_hash(model_dir: Path) -> str:
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                sl = st.get_slice(name)
                shape = sl.get_shape()
                if len(shape) == 1 or name == "model.layers.0.self_attn.k_proj.weight":
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


def save_module(module: torch.nn.Module, out_dir: str | os.PathLike, config: dict) -> Path:
    """Write `config` as config.json and the module's state dict as model.safetensors into
    `out_dir`, each file replaced atomically (a draft module's artifact)."""
    from safetensors.torch import save_file

    from quantspec.outputs import atomic_file, write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    with atomic_file(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out
