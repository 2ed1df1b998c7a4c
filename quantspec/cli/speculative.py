"""vLLM's `--speculative-config` (a JSON object) on `quantspec infer` and `quantspec serve`, read
into quantspec's own speculation flags, so a vLLM command line carries over:

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    --speculative-config '{"method": "eagle3", "model": "smol.eagle3/", "num_speculative_tokens": 4}'

`method` ngram → `inference_with_reference`, eagle / eagle3 → `eagle` (quantspec serves EAGLE-3
heads), medusa, mtp / deepseek_mtp → `mtp`, draft_model (or a `model` without a method) →
`draft`; `model` → `--draft-model`, `num_speculative_tokens` → `--speculate-max-draft-token-num`,
`prompt_lookup_max` / `prompt_lookup_min` → `--speculate-max-ngram-size` /
`--speculate-min-ngram-size`, with vLLM's defaults (one bound gives the other; neither: both 5).
A key quantspec does not read, or a flag it would contradict, is one line naming it (exit 2),
never a silently different setup. A speculators-format EAGLE-3 head given as the model stands
for its verifier speculating with it, as in vLLM (`_speculator_as_model`)."""

from __future__ import annotations

import functools
import json

import click

from quantspec.errors import QuantSpecError

__all__ = ["read_speculative_config", "speculative_config_option"]

METHODS = {"ngram": "inference_with_reference", "eagle": "eagle", "eagle3": "eagle", "medusa": "medusa",
           "mtp": "mtp", "deepseek_mtp": "mtp", "draft_model": "draft"}
# vLLM's key → quantspec's flag (its keyword)
KEYS = {"model": "draft_model", "num_speculative_tokens": "speculate_max_draft_token_num",
        "prompt_lookup_max": "speculate_max_ngram_size", "prompt_lookup_min": "speculate_min_ngram_size"}
VLLM_NGRAM_SIZE = 5  # vLLM's n-gram size where the config gives neither bound


def _positive(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QuantSpecError(f"--speculative-config {key} {value!r} must be an integer >= 1")
    return value


def read_speculative_config(text: str) -> dict:
    """The flags (keyword → value) a `--speculative-config` JSON object stands for."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise QuantSpecError(f"--speculative-config is not JSON ({e}); give an object such as "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'") from None
    if not isinstance(spec, dict):
        raise QuantSpecError("--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    unknown = sorted(set(spec) - set(KEYS) - {"method"})
    if unknown:
        raise QuantSpecError(f"--speculative-config key {unknown[0]!r} is not read by quantspec; use "
                             f"{', '.join(['method', *KEYS])}")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in METHODS:
        raise QuantSpecError(f"--speculative-config method {method!r} is not one of {', '.join(METHODS)}")
    out = {"speculate_method": METHODS[method]}
    for key, flag in KEYS.items():
        if key in spec:
            out[flag] = spec[key] if key == "model" else _positive(key, spec[key])
    if "model" in spec and not isinstance(spec["model"], str):
        raise QuantSpecError("--speculative-config model must be a path (a string)")
    if method != "ngram" and "model" not in spec:
        raise QuantSpecError(f"--speculative-config method {method!r} needs \"model\": the draft's directory")
    if out["speculate_method"] == "inference_with_reference":  # vLLM's n-gram sizes: one gives the other, else 5
        lo, hi = out.get("speculate_min_ngram_size"), out.get("speculate_max_ngram_size")
        out["speculate_min_ngram_size"] = lo or hi or VLLM_NGRAM_SIZE
        out["speculate_max_ngram_size"] = hi or lo or VLLM_NGRAM_SIZE
    return out


def speculative_config_option(fn):
    """Add `--speculative-config JSON` to a command with the `--speculate-*` flags and apply it
    before the command runs (under `one_line_errors`, so a bad config is one line)."""

    @click.option("--speculative-config", default=None,
                  help="vLLM's speculative config as JSON (method, model, num_speculative_tokens, prompt_lookup_max, "
                       "prompt_lookup_min), in place of the --speculate-* flags and --draft-model.")
    @functools.wraps(fn)
    def wrapper(*args, speculative_config=None, **kwargs):
        ctx = click.get_current_context()

        def given(name: str) -> bool:
            return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)

        if speculative_config is not None:
            flags = read_speculative_config(speculative_config)
            for name in ("speculate_method", *KEYS.values()):
                if given(name):
                    raise QuantSpecError(f"--{name.replace('_', '-')} and --speculative-config both set the "
                                         "speculation; give one")
            kwargs.update(flags)
        _speculator_as_model(kwargs, given, speculative_config is not None)
        return fn(*args, **kwargs)

    return wrapper


def _speculator_as_model(kwargs: dict, given, configured: bool) -> None:
    """A speculators-format EAGLE-3 head given as the model (`--model` or serve's MODEL), as in
    vLLM's `vllm serve SPECULATOR`: its verifier becomes the model, speculating with the head
    (`api.speculator_flags`); --speculate-max-draft-token-num still overrides its drafts per step."""
    from quantspec import api

    key = "model_tag" if kwargs.get("model_tag") else "model"
    flags = None if kwargs.get(key) is None else api.speculator_flags(kwargs[key])
    if flags is None:
        return
    if configured or given("speculate_method") or given("draft_model"):
        raise QuantSpecError(f"{kwargs[key]} is a speculators head, which names its own speculation (its verifier "
                             "speculating with it); drop --speculate-method / --draft-model / --speculative-config, "
                             "or pass the base as --model and the head as --draft-model")
    kwargs[key] = flags.pop("model")
    if given("speculate_max_draft_token_num"):
        flags.pop("speculate_max_draft_token_num", None)
    kwargs.update(flags)
