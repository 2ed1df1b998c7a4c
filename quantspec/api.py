"""The user's verbs as Python functions: `infer`, `quantize`, `calibrate`, `evaluate`, `report`.

Each verb takes one typed config (or plain keyword arguments) and composes the wings below it
(`model_zoo`, `quant`, `calib`, `kernels`, `infer`, `report`); the CLI in `cli.py` only parses
flags into these calls and renders results. Python users call the same functions.
"""

from __future__ import annotations

from pathlib import Path

from quantspec import distill
from quantspec.calib.eval_inputs import eval_kv_cache, eval_tokens, table_kv_scales
from quantspec.errors import QuantSpecError, about, positive_int
from quantspec.outputs import check_output_dir, check_output_file

# the config types and names a caller (the CLI) builds calls with, imported when first asked for
_REEXPORTS = {"InferConfig": "quantspec.infer.predictor", "ServeConfig": "quantspec.serve", "ReportConfig": "quantspec.report",
              "ENGINE_NAMES": "quantspec.quant.engines", "rotate_eagle3_head": "quantspec.calib.rotate_head"}

__all__ = ["calibrate", "evaluate", "infer", "inspect", "quantize", "report", "serve", "train_draft_head", "train_mtp",
           *_REEXPORTS]


def __getattr__(name: str):
    if name in _REEXPORTS:
        import importlib

        value = getattr(importlib.import_module(_REEXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quantspec.api' has no attribute {name!r}")


def infer(config, prompts: list[str] | None = None, *, data_file: str | Path | None = None,
          output_file: str | Path | None = None, calib: str | Path | None = None, on_text=None):
    """Generate for `prompts` or the `src` rows of a jsonl `data_file`.

    Returns (outputs, stats). With `output_file`, writes each input row plus `output` (text) and
    `output_token_ids` (with `config.logprobs`: `output_logprobs`, one per token, and for n > 0
    `output_top_logprobs`, the n most likely [token id, log-probability] pairs of each position),
    atomically. `config` is an `infer.predictor.InferConfig`; `calib` is a
    calibration table whose KV scales the static KV cache of `config.cachekv` uses.
    """
    from quantspec.infer.predictor import Predictor, read_jsonl, write_jsonl

    if (prompts is None) == (data_file is None):
        raise QuantSpecError("give either --prompt or --data-file (not both)")
    if output_file is not None:
        check_output_file(output_file, "--output-file")
    elif config.logprobs is not None:
        raise QuantSpecError("--logprobs goes into the --output-file rows; add --output-file FILE.jsonl")
    rows = read_jsonl(data_file) if data_file is not None else [{"src": p} for p in prompts]
    kv_scales = None
    if calib is not None:
        if config.cachekv in ("none", "float"):
            raise QuantSpecError("--calib gives static KV-cache scales: add --kv-cache-dtype fp8 or int8 (or "
                                 "--cachekv-int8-type / --cachekv-fp8-type static), or drop --calib")
        kv_scales = table_kv_scales(calib, config.model, config.cachekv)
    predictor = Predictor(config, kv_scales=kv_scales)
    outs, stats = predictor.run([r["src"] for r in rows], on_text=on_text)
    if output_file is not None:
        write_jsonl(output_file, [dict(r, output=o.text, output_token_ids=o.token_ids, **_logprob_fields(config, o))
                                  for r, o in zip(rows, outs)])
    return outs, stats


def _logprob_fields(config, out) -> dict:
    if config.logprobs is None:
        return {}
    fields = {"output_logprobs": [lp.logprob for lp in out.logprobs]}
    if config.logprobs:
        fields["output_top_logprobs"] = [[list(pair) for pair in lp.top] for lp in out.logprobs]
    return fields


def speculator_flags(model: str | Path) -> dict | None:
    """For a speculators-format EAGLE-3 head given as the model (vLLM's `vllm serve SPECULATOR`),
    the `infer` / `serve` keywords it stands for (its verifier as the model, the head as the
    draft, its drafts per step); None for anything else."""
    from quantspec.model_zoo.checkpoint import read_config
    from quantspec.model_zoo.speculators import is_speculators_config, speculation_flags

    path = Path(str(model)).expanduser()
    try:
        cfg = read_config(path) if (path / "config.json").is_file() else {}
    except QuantSpecError:  # not JSON: the model's loading says so, naming --model
        return None
    return speculation_flags(cfg, str(path)) if is_speculators_config(cfg) else None


def serve(config, *, on_ready=None, on_stats=None) -> None:
    """Serve `config.model` over OpenAI's HTTP API (`serve.ServeConfig`) until SIGTERM or Ctrl-C,
    then drain the requests in flight and return. `on_ready(url, kv_cache, sampling_defaults)` is
    called once the model is loaded (`kv_cache`: which KV cache the engine runs;
    `sampling_defaults`: what requests that leave those fields out get, from --generation-config).
    `on_stats(line)` gets a line of throughput, queue and KV-cache use every 10 s while busy.
    `config.calib`: the calibration table whose KV scales a static `config.kv_cache_dtype` uses."""
    from quantspec.serve import run

    kv_scales = None
    if config.calib is not None:
        kv_scales = table_kv_scales(config.calib, config.model, config.infer_config().cachekv)
    run(config, on_ready=on_ready, on_stats=on_stats, kv_scales=kv_scales)


def train_mtp(model: str | Path = "smollm2-135m", dataset: str | Path | None = None, out: str | Path | None = None,
              *, split: str = "train", text_field: str = "text", steps: int = 1500, seq_len: int = 256,
              batch_size: int = 4, num_samples: int = 16, lr: float = 1e-3, self_distill: bool = True,
              chat_prompts: list[str] | int | None = None, max_new_tokens: int = 160, gen_batch_size: int = 64,
              draft_vocab_size: int = 4096, chain_weight: float = 0.5, save_every: int = 250, seed: int = 0,
              targets: str = "hard", resume: bool = False, on_step=None, on_status=None) -> dict:
    """Train an MTP module for the frozen `model` (`quantspec zoo train-mtp`); writes the MTP
    artifact (config.json + model.safetensors) and `train_state.pt` into `out`.

    Data: `num_samples` windows of `seq_len` tokens from `dataset` (calib's loader/packer), and —
    with `self_distill` — the base's own greedy answers (`max_new_tokens`) to `chat_prompts`
    (a list, or how many of the built-in `model_zoo.mtp_train.chat_prompts()`; default
    `CHAT_PROMPTS`, all 1618 of them), whose hidden states are captured while
    generating. Each step trains on `batch_size * seq_len` positions. `targets`: "hard" (the
    default) = one token per position (the base's argmax with `self_distill`, else the dataset's
    next token); "soft" = the base's distribution over the draft vocabulary at each position
    (needs `self_distill`).
    `on_step(step, steps, loss)` and `on_status(message)` report progress.

    The prepared training rows are saved to `out/train_features.pt` before training (the
    self-distillation answers are most of the default recipe's ~30 min) and deleted when the run
    completes: a run interrupted before that, resumed or started again into the same `out` with
    the same data options and base, trains on them instead of preparing them again. A `resume`
    of a run already at `steps` returns at once. Returns a summary dict.
    """
    import time

    from quantspec.model_zoo.mtp_train import FEATURES_NAME, MTPTrainConfig, check_resumable, init_mtp
    from quantspec.model_zoo.mtp_train import train_mtp as _train

    if out is None:
        raise QuantSpecError("--out is required: the directory to write the MTP module to")
    if dataset is None and not self_distill:
        raise QuantSpecError("no training data: pass --dataset, or keep --self-distill")
    if targets not in ("soft", "hard"):
        raise QuantSpecError(f"--targets {targets!r}: use 'soft' or 'hard'")
    if targets == "soft" and not self_distill:
        raise QuantSpecError("soft targets are the base's own distribution (self-distillation): drop "
                             "--no-self-distill, or pass --targets hard to train on the dataset's tokens")
    config = MTPTrainConfig(steps=steps, batch_tokens=batch_size * seq_len, lr=lr, chain_weight=chain_weight,
                            save_every=save_every, seed=seed, draft_vocab_size=draft_vocab_size,
                            soft_targets=targets == "soft")
    check_output_dir(out, "--out", overwrite=True)  # an existing run there is resumed or refused below
    done = check_resumable(out, config, resume)  # before minutes of feature extraction
    if done is not None and done >= steps:  # nothing to train: no data to prepare either
        return {"steps": steps, "start_step": done, "loss_first": None, "loss_last": None, "losses": [],
                "positions": None, "out": str(out), "wall_s": 0.0}
    t0 = time.perf_counter()
    base, features, vocab, data = distill.self_distilled_rows(
        model, out, dataset, split=split, text_field=text_field, num_samples=num_samples, seq_len=seq_len,
        seed=seed, self_distill=self_distill, chat_prompts=chat_prompts, max_new_tokens=max_new_tokens,
        gen_batch_size=gen_batch_size, draft_vocab_size=draft_vocab_size, on_status=on_status)
    data = {**data, "targets": targets}  # the objective, not the data: not in the saved rows' key
    mtp = init_mtp(base, vocab, seed)
    data.update(positions=len(features), base=str(model))
    res = _train(mtp, features, config, out, resume=resume, extra_config=data, on_step=on_step)
    (Path(out) / FEATURES_NAME).unlink(missing_ok=True)  # the run is complete: the artifact is what it was for
    res.update(data, out=str(out), wall_s=round(time.perf_counter() - t0, 1))
    return res


def train_draft_head(kind: str = "medusa", model: str | Path = "smollm2-135m", out: str | Path | None = None, *,
                     num_heads: int = 4, num_layers: int = 1, dataset: str | Path | None = None,
                     steps: int | None = None, batch_size: int = 4, seq_len: int = 256, lr: float = 1e-3,
                     chat_prompts: list[str] | int | None = None,
                     max_new_tokens: int = 160, draft_vocab_size: int = 4096, save_every: int = 100, seed: int = 0,
                     resume: bool = False, on_step=None, on_status=None, **data_options) -> dict:
    """Train a draft head for the frozen `model` (`quantspec zoo train-draft-head`) on the MTP
    recipe's self-distilled rows; `kind` "medusa": `num_heads` Medusa heads of `num_layers`
    ResBlocks in the Medusa authors' layout (`model_zoo/medusa.py`). Resumable like `train_mtp`.
    `steps` / `chat_prompts` None: the kind's default recipe (eagle3: `EAGLE3_STEPS` steps on the
    first `EAGLE3_CHAT_PROMPTS` built-in prompts; medusa: 300 steps on all of them). Returns a
    summary dict."""
    import time

    from quantspec.model_zoo.eagle3_train import EAGLE3_CHAT_PROMPTS, EAGLE3_STEPS
    from quantspec.model_zoo.medusa_train import init_medusa, train_medusa
    from quantspec.model_zoo.mtp_train import FEATURES_NAME, MTPTrainConfig, check_resumable

    if kind not in ("medusa", "eagle3"):
        raise QuantSpecError(f"--kind {kind!r} is not trained here; use --kind medusa or eagle3")
    if out is None:
        raise QuantSpecError("--out is required: the directory to write the heads to")
    if kind == "eagle3":
        return distill.train_eagle3_head(
            model, out, dataset=dataset, steps=EAGLE3_STEPS if steps is None else steps, seqs_per_step=batch_size,
            seq_len=seq_len, lr=lr, chat_prompts=EAGLE3_CHAT_PROMPTS if chat_prompts is None else chat_prompts,
            max_new_tokens=max_new_tokens, draft_vocab_size=draft_vocab_size, save_every=save_every, seed=seed,
            resume=resume, on_step=on_step, on_status=on_status, **data_options)
    if num_heads < 1 or num_layers < 0:
        raise QuantSpecError(f"--num-heads {num_heads} / --num-layers {num_layers}: use >= 1 heads, >= 0 layers")
    steps = 300 if steps is None else steps
    config = MTPTrainConfig(steps=steps, batch_tokens=batch_size * seq_len, lr=lr, save_every=save_every, seed=seed,
                            draft_vocab_size=draft_vocab_size)
    check_output_dir(out, "--out", overwrite=True)
    done = check_resumable(out, config, resume)
    if done is not None and done >= steps:
        return {"steps": steps, "start_step": done, "loss_first": None, "loss_last": None, "losses": [],
                "positions": None, "out": str(out), "wall_s": 0.0}
    t0 = time.perf_counter()
    opts = dict(split="train", text_field="text", num_samples=16, self_distill=True, gen_batch_size=64)
    opts.update(data_options)
    base, features, vocab, data = distill.self_distilled_rows(
        model, out, dataset, seq_len=seq_len, seed=seed, chat_prompts=chat_prompts, max_new_tokens=max_new_tokens,
        draft_vocab_size=draft_vocab_size, on_status=on_status, **opts)
    heads = init_medusa(base, vocab, num_heads, num_layers)
    data.update(positions=len(features), base=str(model), kind=kind)
    res = train_medusa(heads, base, features, config, out, resume=resume, extra_config=data, on_step=on_step)
    (Path(out) / FEATURES_NAME).unlink(missing_ok=True)
    res.update(data, out=str(out), wall_s=round(time.perf_counter() - t0, 1))
    return res


def _dir_bytes(path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())


def quantize(model: str | Path = "smollm2-135m", quant_type: str | None = None,
             out: str | Path | None = None, *, recipe: str | Path | None = None, progress=None, on_status=None,
             **options) -> Path:
    """Quantize a checkpoint into an artifact directory at `out`; returns its path.

    `options` are the fields of `calib.quantize.QuantizeConfig` (method, group_size, symmetric,
    zp_dtype, weight_observer, ignore, layer_quant_types, act_order, block_size, damp, iters, lr, batch_size,
    dataset, base, split, text_field,
    num_samples, seq_len, seed, calib, activations, weight_block, weight_strategy, smoothquant_alpha, kv_cache, kv_strategy, target,
    compute_capability, fallback_layers, fallback_threshold, fallback_budget, search_samples, holdout_samples, overwrite, rotate, quip,
    quip_block_size), checked when the config is built. `target` defaults to "portable" (what vLLM and
    SGLang load with the intended scheme); options only quantspec runs (float zero points, int8
    KV-cache scales, MTP modules) need target="quantspec". The artifact: config.json = the source config + its
    `quantization_config` (compressed-tensors layout), the tensors in compressed-tensors names, the
    tokenizer files, and `quantspec.json` provenance; written atomically (`calib.quantize`).
    `progress(layer, num_layers, phase)` is called per decoder layer, `on_status(message)` at each
    phase. `quant_type="keep"` copies a compressed-tensors artifact's weights as they are and adds
    the KV-cache scales of `calib` (`kv_cache`, `kv_strategy`, `target`, `overwrite` apply;
    `calib.keep`). `recipe`: an llm-compressor recipe file whose options (`calib.recipe`) the run
    takes, with `quant_type` and `options` beside it for what the recipe leaves open (one it sets
    too is refused); `quant_type` is otherwise "weight_only_int8" where not given.
    """
    from quantspec.calib.keep import KEEP, run_keep
    from quantspec.calib.quantize import QuantizeConfig, run_quantize

    say = on_status or (lambda _m: None)
    if recipe is not None:
        from quantspec.calib.recipe import with_recipe

        quant_type, options = with_recipe(str(recipe), quant_type, options, say)
    if quant_type == KEEP:  # the artifact's weights as they are, KV-cache scales added
        options = {k: str(v) if isinstance(v, Path) else v for k, v in options.items() if k != "restart"}
        return run_keep({"model": str(model), "quant_type": quant_type, "out": None if out is None else str(out),
                         **options}, say=say)
    try:
        config = QuantizeConfig(model=str(model), quant_type=quant_type or "weight_only_int8",
                                out=None if out is None else str(out),
                                **{k: str(v) if isinstance(v, Path) else v for k, v in options.items()})
    except TypeError as e:  # an unknown keyword
        raise QuantSpecError(f"quantize: {e}") from None
    return run_quantize(config, progress=progress, on_status=on_status)


# checkpoints in another tool's own format, which the engines read with their own method for it
_OWN_FORMATS = {"fp8": "fp8 (quant_method 'fp8': transformers' / vLLM's own FP8 checkpoint)",
                "modelopt": "modelopt NVFP4 (NVIDIA ModelOpt's own checkpoint)", "awq": "awq (AutoAWQ's own checkpoint)",
                "gptq": "gptq (AutoGPTQ's / GPTQModel's own checkpoint)", "quark": "quark FP8 (AMD Quark's own checkpoint)",
                "auto-round": "auto-round (Intel AutoRound's own checkpoint)", "fbgemm_fp8": "fbgemm_fp8 (FBGEMM's FP8 checkpoint)"}


def inspect(path: str | Path, *, compute_capability=None) -> dict:
    """What an artifact (or plain checkpoint) holds: scheme, per-Linear bits / group size,
    size on disk and compression ratio vs the source (from provenance), and each engine's
    verdict (for a quantized artifact, or a draft module quantized or not) on a GPU of
    `compute_capability` ("8.0", "9.0", ...; None: Hopper's 9.0)."""
    from quantspec.model_zoo.checkpoint import (draft_kind, read_config, resolve_model_dir, safetensors_files,
                                                safetensors_keys)
    from quantspec.model_zoo.hf_config import rotation_tag
    from quantspec.quant.artifact import quantized_layers, read_provenance, read_quant_config
    from quantspec.quant.transforms import run_time_transforms
    from quantspec.quant.bnb import BNB_METHOD, bnb_inspect
    from quantspec.quant.engines import draft_verdicts, parse_capability

    capability = parse_capability(compute_capability)
    with about("PATH"):
        d = resolve_model_dir(path)
        files = safetensors_files(d)
        names = [k for f in files for k in safetensors_keys(f)]
        out = {"path": str(d), "size_bytes": _dir_bytes(d), "weights_bytes": sum(f.stat().st_size for f in files),
               "num_tensors": len(names)}
        if ((c := read_config(d)).get("quantization_config") or {}).get("quant_method") == BNB_METHOD:
            return {**out, **bnb_inspect(d, c)}  # a source only: no compressed-tensors config to read
        qc = read_quant_config(d)
        meta = read_provenance(d)
    weights_bytes, prov = out["weights_bytes"], meta.get("provenance") or {}
    out["quantized"] = qc is not None
    if qc is None:  # a draft module's verdicts need no quantization_config
        kind = draft_kind(c)
        return out if kind is None else {**out, "engines": {e: v.to_dict() for e, v in draft_verdicts(kind, c).items()}}
    layers = quantized_layers(qc, names, d)
    src = prov.get("source_size_bytes")
    out.update(
        quant_type=None if qc.quant_type is None else qc.quant_type.value,
        format=qc.format, ignore=list(qc.ignore),
        kv_cache=None if qc.kv_cache_scheme is None else qc.kv_cache_scheme.to_dict(),
        config_groups={g: sc.to_dict() for g, sc in qc.config_groups.items()},
        layers=layers, source_size_bytes=src,
        compression_ratio=None if not src else round(src / weights_bytes, 3),
        method=prov.get("method"), quantspec_version=prov.get("quantspec_version"),
        calibration=prov.get("calibration"), wall_time_s=prov.get("wall_time_s"),
        source_quantization=prov.get("source_quantization"), recipe=prov.get("recipe"),
        llmcompressor_recipe=str(d / "recipe.yaml") if (d / "recipe.yaml").is_file() else None,
    )
    out.update({"rotation": rot} if (rot := rotation_tag(c)) else {})  # fused rotations (`calib.rotate`)
    out.update({"run_time_transforms": t} if (t := run_time_transforms(qc)) else {})  # QuIP's (`calib.quip`)
    own = _OWN_FORMATS.get(c["quantization_config"].get("quant_method"))
    if own is not None:  # vLLM, SGLang and transformers read it with their own method, not compressed-tensors'
        out["format"] = own
    else:
        out["engines"] = {e: v.to_dict() for e, v in _engine_verdicts(c, qc, files, layers, capability).items()}
        out["compute_capability"] = f"{capability // 10}.{capability % 10}"
    if any(s.input_activations is not None for s in qc.config_groups.values()):
        out.update(_activation_info(layers, prov))
    return out


def _activation_info(layers: dict, prov: dict) -> dict:
    """a8w8 types: how many Linears quantize their inputs (static or dynamic), which fell back (W8A16) and why."""
    acts = [d["input_activations"] or "" for d in layers.values()]
    out = {"activation_linears": sum(map(bool, acts)), "static_activation_linears": sum(a.endswith("static") for a in acts),
           "fallback_layers": [n for n, d in layers.items() if d["input_activations"] is None]}
    if (plan := (prov.get("calibration") or {}).get("static_plan")) is not None:
        out["fallback"] = {"rule": plan.get("fallback_rule"), "units": plan.get("fallback_units"),
                           "held_back": plan.get("held_back")}
    return out


def _engine_verdicts(cfg: dict, qc, files, layers: dict, capability: int) -> dict:
    """`quant.engines.engine_verdicts` for the artifact of config.json `cfg`: its quantized Linears with their
    input and output dims (from `weight_shape` or the code tensor's shape), whether it is a draft module and,
    for an EAGLE-3 head, its base's layer count (the index vLLM gives the head's layer)."""
    from safetensors import safe_open

    from quantspec.model_zoo.checkpoint import draft_kind, reading_safetensors
    from quantspec.quant.engines import engine_verdicts

    dims: dict[str, int | None] = dict.fromkeys(layers)
    rows: dict[str, int] = {}
    for f in files:
        with reading_safetensors(f), safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                name, _, leaf = k.rpartition(".")
                if name not in dims or leaf not in ("weight_shape", "weight"):
                    continue
                shape = h.get_tensor(k).tolist() if leaf == "weight_shape" else h.get_slice(k).get_shape()
                rows[name], dims[name] = int(shape[0]), int(shape[1])
    return engine_verdicts(qc, dims, capability=capability, draft=draft_kind(cfg), draft_config=cfg, rows=rows,
                           base_layers=(cfg.get("quantspec") or {}).get("base_num_layers"))


def evaluate(model: str | Path = "smollm2-135m", *, text_file: str | Path | None = None,
             dataset: str | None = None, split: str = "test", text_field: str = "text",
             seq_len: int = 512, max_windows: int | None = None, batch_size: int = 4,
             dtype: str = "float32", device: str = "cpu", kv_cache_dtype: str = "auto",
             calib: str | Path | None = None, reference: str | Path | None = None, progress=None) -> dict:
    """Perplexity of a model or artifact on a text file or dataset, through the inference path
    (paged KV cache). `kv_cache_dtype`: "auto" runs the artifact's static KV cache when it stores
    `k_scale` / `v_scale` (as `infer` does), else a float one; "float" forces a float KV cache;
    "int8" / "fp8" a static one with scales from `calib` or from the artifact. `reference` (the model
    it was quantized from, with its own KV cache): KL divergence and top-1 agreement against it too
    (`infer.evaluate.compare`). Returns `PerplexityResult.to_dict()` (with `reference`:
    `ComparisonResult`'s) + model, source and `kv_cache` (which KV cache ran, the scales' origin)."""
    import torch

    from quantspec.devices import resolve_device
    from quantspec.infer.evaluate import compare, perplexity
    from quantspec.infer.kv_cache import kv_cache_label
    from quantspec.infer.loader import load_for_inference

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise QuantSpecError(f"unknown --dtype {dtype!r}; use one of: {', '.join(dtypes)}")
    if kv_cache_dtype not in ("auto", "float", "int8", "fp8"):
        raise QuantSpecError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; use auto, float, int8 or fp8")
    if (text_file is None) == (dataset is None):
        raise QuantSpecError("pass exactly one of --text-file or --dataset")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise QuantSpecError(f"--seq-len {seq_len!r} must be an integer ≥ 2")
    positive_int("batch_size", batch_size)
    if max_windows is not None:
        positive_int("max_windows", max_windows)
    if calib is not None and kv_cache_dtype in ("auto", "float"):
        raise QuantSpecError("--calib gives static KV-cache scales: add --kv-cache-dtype int8 or fp8, or drop --calib")
    loaded = []
    for flag, name in (("--model", model), ("--reference", reference)):
        with about(flag):
            loaded.append(None if name is None else load_for_inference(str(name), dtype=dtypes[dtype],
                                                                         device=resolve_device(device)))
    em, ref = loaded
    em.args.check_context(seq_len, "--seq-len")
    kind, k_scale, v_scale, origin = eval_kv_cache(em, kv_cache_dtype, calib)
    with about("--text-file" if text_file is not None else "--dataset"):
        ids = eval_tokens(em.tokenizer, text_file=text_file, dataset=dataset, split=split, text_field=text_field)
    kv = dict(kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
    if ref is None:
        res = perplexity(em.model, ids, seq_len=seq_len, max_windows=max_windows, batch_size=batch_size,
                         progress=progress, **kv)
    else:
        ref.args.check_context(seq_len, "--seq-len")
        theirs = ids if ref.tokenizer is None else eval_tokens(ref.tokenizer, text_file=text_file, dataset=dataset,
                                                               split=split, text_field=text_field)
        if not torch.equal(ids, theirs):  # without a tokenizer of its own, its vocabulary is checked alone
            raise QuantSpecError(f"--reference {reference} tokenizes the text otherwise than --model {model}; pass "
                                 "the model it was quantized from")
        rkind, rk, rv, _ = eval_kv_cache(ref, "auto", None)
        res = compare(em.model, ref.model, ids, seq_len=seq_len, max_windows=max_windows, batch_size=batch_size,
                      kv=kv, reference_kv=dict(kv_cache_dtype=rkind, k_scale=rk, v_scale=rv), progress=progress)
    return {"model": str(model), "source": str(text_file or dataset), **res.to_dict(),
            **({"reference": str(reference)} if reference is not None else {}),
            "kv_cache": kv_cache_label(kind, dtype, origin)}


def calibrate(model: str = "smollm2-135m", dataset: str | None = None, out: str | Path | None = None,
              *, split: str = "train", text_field: str = "text", num_samples: int = 128,
              seq_len: int = 512, seed: int = 0, observer: str = "minmax",
              percentile: float = 99.99, kv_observer: str | None = None, device: str = "auto",
              batch_size: int = 8, dtype: str = "auto", overwrite: bool = False, restart: bool = False,
              resumable: bool | None = None, rotate: str | None = None, base: str | None = None, progress=None,
              on_status=None):
    """Measure static activation + KV-cache scales of `model` on `dataset`; write the table `out`.

    Returns a `calib.calibrate.CalibrationResult` (path, meta, wall_s). `progress(i, L, phase)`
    is called per decoder layer; `rotate` measures the model with the rotations `quantize(rotate=)`
    fuses (`calib.rotate`). A draft module (MTP, Medusa, EAGLE-3) is measured as it drafts on
    its base: `base`, or the one it records (`calib.draft_scales`). See `quantspec.calib.calibrate`
    and `quantspec.calib.tables`.
    """
    from quantspec.calib.calibrate import CalibrateConfig, run_calibration

    config = CalibrateConfig(
        dataset=None if dataset is None else str(dataset), out=None if out is None else str(out),
        model=str(model), split=split, text_field=text_field, num_samples=num_samples,
        seq_len=seq_len, seed=seed, observer=observer, percentile=percentile,
        kv_observer=kv_observer, batch_size=batch_size, dtype=dtype, device=device, overwrite=overwrite,
        restart=restart, resumable=resumable, rotate=rotate, base=base)
    return run_calibration(config, progress=progress, on_status=on_status)


def report(config=None, *, progress=None, **kwargs):
    """The per-pair compatibility matrix (`quantspec report`); returns a `report.matrix.Report`.

    `config` is a `report.config.ReportConfig`, or pass its fields as keyword arguments
    (`out=` is required). The report runs this module's own `quantize`, `calibrate` and
    `evaluate`, so its artifacts are exactly what those commands make. `progress(event, cell,
    index, total, result)` is called around each cell ("start" / "done" / "skip").
    """
    from quantspec.report import Pipeline, ReportConfig, run_report

    if config is None:
        config = ReportConfig(**kwargs)
    elif kwargs:
        from quantspec.errors import QuantSpecError

        raise QuantSpecError("pass either a ReportConfig or keyword arguments to report(), not both")
    pipeline = Pipeline(quantize=quantize, evaluate=evaluate, calibrate=calibrate, kv_scales=table_kv_scales)
    return run_report(config, pipeline, progress=progress)
