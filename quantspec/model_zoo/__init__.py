"""Architectures as plain nn.Modules, checkpoint loading, the default model and test builders."""

from quantspec.model_zoo.checkpoint import load_model, resolve_model_dir
from quantspec.model_zoo.default import DEFAULT_MODEL
from quantspec.model_zoo.llama import ModelArgs, Transformer

__all__ = ["DEFAULT_MODEL", "ModelArgs", "Transformer", "load_model", "resolve_model_dir"]
