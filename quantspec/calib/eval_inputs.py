"""What `quantspec eval` reads beside its model: the text as token ids, and the KV-cache scales of a
static KV cache (the artifact's, or a calibration table's)."""

from __future__ import annotations

from pathlib import Path

from quantspec.errors import QuantSpecError, about

__all__ = ["eval_kv_cache", "eval_tokens", "table_kv_scales"]


def eval_kv_cache(em, kv_cache_dtype: str, calib):
    """(KV cache dtype for `perplexity`, k_scale, v_scale, where the scales come from) of the loaded
    model `em` (`infer.loader`) under `--kv-cache-dtype` (`kv_cache_dtype`) and `--calib` (`calib`)."""
    if kv_cache_dtype == "float" or (kv_cache_dtype == "auto" and em.kv_cache_dtype is None):
        return "auto", None, None, None
    kind = em.kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if calib is not None:
        from quantspec.calib.tables import read_table

        with about("--calib"):
            k_scale, v_scale = read_table(calib, model_dir=em.model_dir).kv_scales(kind)
        return kind, k_scale, v_scale, f"scales from {calib}"
    if em.k_scale is None:
        raise QuantSpecError(f"a static {kind} KV cache needs scales: pass --calib DIR "
                             "from `quantspec calibrate`, or an artifact that stores k/v scales")
    return kind, em.k_scale, em.v_scale, "the artifact's scales"


def table_kv_scales(calib: str | Path, model: str | Path, kind: str):
    """(k_scale, v_scale) [num_layers, num_kv_heads] for an `kind` ("int8" / "fp8") KV cache,
    from the calibration table `calib` of `model` (checked against the model's fingerprint)."""
    from quantspec.calib.tables import read_table
    from quantspec.model_zoo.checkpoint import resolve_model_dir

    with about("--model"):
        model_dir = resolve_model_dir(model)
    with about("--calib"):
        return read_table(calib, model_dir=model_dir).kv_scales(kind)


def eval_tokens(tokenizer, *, text_file=None, dataset: str | None = None, split: str = "test",
                text_field: str = "text"):
    """A text file or a dataset's texts (rows joined with blank lines), tokenized as one stream
    without special tokens → LongTensor [N]."""
    import torch

    from quantspec.calib.data import load_calibration_texts, load_text_file_for_eval

    if text_file is not None:
        text = load_text_file_for_eval(text_file)
    else:
        text = "\n\n".join(load_calibration_texts(dataset, split=split, text_field=text_field))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
