"""`quantspec calibrate`: run a model over calibration data and write its static scale table.

This file owns the calibration pass: a typed `CalibrateConfig`, the per-layer observer set
(`LayerObservers`) and the driver (`calibrate_model` on token batches, `run_calibration` from a
model + dataset to a table directory). Lifecycle (llm-compressor style): initialize (load model,
tokenize, build the batch) → per decoder layer (attach observers, run the layer over every
sample with `calib.runner.LayerRunner`, compute, drop the observers) → finalize (write the table
with `calib.tables.write_table`).

What is observed, per decoder layer i:
- every Linear's input, via a forward pre-hook: a per-tensor observer of the chosen kind
  (minmax / percentile / mse) → `{linear}.input_absmax` [], and a per-channel min/max observer
  → `{linear}.input_channel_absmax` [K] (SmoothQuant needs max|X_j|). Linears that read the very
  same tensor (q/k/v, gate/up) share one pair of observers (detected by object identity of the
  input in the same forward), so the work is done once. With the minmax observer the per-tensor
  absmax is the max of the per-channel one (exactly what a separate observer would return), so
  no second pass over the activations is made;
- the post-rotary K and V per KV head, via the attention's `kv_hook` (what the paged cache
  stores) → `model.layers.{i}.self_attn.k_absmax` / `v_absmax` [KV], observer `kv_observer`
  (default `DEFAULT_KV_OBSERVER` = mse, the measured winner for the static KV cache).
The MSE observer searches its clipping on the int8 grid (the table serves int8 and fp8).

A NaN/Inf activation raises `QuantSpecError` naming the Linear (observer) or layer (runner).

A draft module (MTP, Medusa, EAGLE-3) is observed whole, as it drafts on its base's hidden states,
by the same observers (`calib.draft_scales`).

Models larger than memory: the model is built on the `meta` device and each decoder layer is read
from the checkpoint's safetensors just before it runs (onto `device`) and released after
(`calib.runner`), so resident memory is one layer's weights and its activations, whatever the
depth. Each layer's table entries go to the run's working directory as the layer finishes
(`calib.stream`); a big run that does not complete keeps it, with the next layer's inputs, and
the same command resumes from the last finished layer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantspec.calib.observers import (
    DEFAULT_PERCENTILE,
    OBSERVERS,
    Observer,
    make_observer,
)
from quantspec.calib.ptq import PartSink, layer_key
from quantspec.calib.runner import DEFAULT_BATCH_SIZE, LayerRunner
from quantspec.model_zoo.moe import all_experts
from quantspec.calib.tables import INPUT_ABSMAX, INPUT_CHANNEL_ABSMAX, write_table
from quantspec.errors import QuantSpecError, about, positive_int
from quantspec.model_zoo.checkpoint import CheckpointReader, model_fingerprint
from quantspec.outputs import check_output_dir

__all__ = [
    "CalibrateConfig",
    "CalibrationResult",
    "LayerObservers",
    "calibrate_model",
    "run_calibration",
]

# Observer of the K/V per-head scales when none is asked for. MSE (clipping searched per head)
# measured on SmolLM2-135M, 64 × 512 calibration tokens, held-out ppl vs fp32: int8 KV +0.34%
# (minmax +0.51%), fp8 KV +0.36% (minmax +1.10%) — see bench/quality_static.py.
DEFAULT_KV_OBSERVER = "mse"
CALIBRATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Progress = Callable[[int, int, str], None]  # (layer index, num layers, phase "start"/"done")


def _cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 (Linux flags); elsewhere False, so bf16 is never chosen where
    it would be emulated (several times slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def resolve_calibration_dtype(name: str) -> str:
    """`auto` → the forward dtype of calibration (which runs on the CPU): bfloat16 where the CPU
    computes it natively (AVX512-BF16/AMX), else float32; a named dtype is kept.

    bf16 is the dtype most checkpoints ship in and what llm-compressor calibrates in. Measured on
    the default model (64 × 512 tokens, held-out ppl with the resulting table, fp32 vs bf16
    forward): KV int8 22.293 vs 22.298, KV fp8 22.325 vs 22.327, a8w8_fp8 22.99 vs 23.09, a8w8
    (α search, 8 fallback) 23.37 vs 23.33 — differences of the size of the calibration noise —
    at 2.3x the linear throughput on an AVX512-BF16 CPU. The table records the dtype used.
    """
    if name != "auto":
        return name
    return "bfloat16" if _cpu_has_native_bf16() else "float32"


@dataclass(frozen=True)
class CalibrateConfig:
    """Everything `quantspec calibrate` needs; validated when built (one line per bad field)."""

    dataset: str
    out: str
    model: str = "smollm2-135m"
    split: str = "train"
    text_field: str = "text"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    observer: str = "minmax"
    percentile: float = DEFAULT_PERCENTILE
    kv_observer: str | None = None  # None: DEFAULT_KV_OBSERVER
    batch_size: int = DEFAULT_BATCH_SIZE
    dtype: str = "auto"  # see resolve_calibration_dtype
    device: str = "auto"  # where each layer runs: auto (CUDA when there is one), cpu, cuda[:N]
    overwrite: bool = False
    restart: bool = False  # discard the state an interrupted run left for `out` (calib.stream)
    resumable: bool | None = None  # keep a state to resume from; None: for checkpoints ≥ 1 GiB
    # measure the model with these rotations fused (`calib.rotate`; signs from `seed`), and with R4's
    # down_proj inputs turned as the engine turns them (`calib.quip.turned_inputs`)
    rotate: str | None = None
    base: str | None = None  # a draft module's base, whose hidden states it is measured on (`calib.draft_scales`)

    @property
    def rotation(self):
        """`rotate`'s fused rotations parsed (`calib.rotate.Rotation`, None for none; one line
        naming --rotate if bad)."""
        from quantspec.calib.rotate import Rotation, split_rotate

        return Rotation.parse(split_rotate(self.rotate)[0], self.seed)

    @property
    def r4(self) -> bool:
        """Whether `rotate` names SpinQuant's R4."""
        from quantspec.calib.rotate import split_rotate

        return split_rotate(self.rotate)[1]

    def __post_init__(self):
        _ = self.rotation  # a bad --rotate fails here, before any work
        if not self.dataset:
            raise QuantSpecError("--dataset is empty; pass --dataset FILE or a hub dataset id")
        if not self.out:
            raise QuantSpecError("--out is empty; pass --out DIR for the calibration table")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise QuantSpecError("--text-field is empty; pass --text-field (the dataset column with "
                                 "the text)")
        positive_int("num_samples", self.num_samples)
        positive_int("seq_len", self.seq_len)
        positive_int("batch_size", self.batch_size)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise QuantSpecError(f"--seed {self.seed!r} must be an integer")
        if self.observer not in OBSERVERS:
            raise QuantSpecError(f"--observer {self.observer!r} unknown; use one of: "
                                 f"{', '.join(OBSERVERS)}")
        if self.kv_observer is not None and self.kv_observer not in OBSERVERS:
            raise QuantSpecError(f"--kv-observer {self.kv_observer!r} unknown; use one of: "
                                 f"{', '.join(OBSERVERS)}")
        if not isinstance(self.percentile, (int, float)) or not 50.0 < float(self.percentile) <= 100.0:
            raise QuantSpecError(f"--percentile {self.percentile!r} must be in (50, 100], e.g. 99.99")
        if self.dtype != "auto" and self.dtype not in CALIBRATION_DTYPES:
            raise QuantSpecError(f"--dtype {self.dtype!r} unsupported; use auto or one of "
                                 f"{', '.join(CALIBRATION_DTYPES)}")


@dataclass
class CalibrationResult:
    """What `run_calibration` returns: where the table is, its metadata and timings (s)."""

    path: Path
    meta: dict
    wall_s: float
    forward_s: float


class LayerObservers:
    """Observers for one decoder layer (or a whole draft module): Linear inputs (pre-hooks) and
    K/V heads (kv_hook)."""

    def __init__(self, layer_name: str, observer: str, percentile: float,
                 kv_observer: str | None = None, attention: str | None = "self_attn"):
        """`layer_name`: the prefix of every entry ("" for a whole draft module); `attention`:
        the attention whose K/V `kv_hook` observes, relative to it (None: no K/V entries)."""
        self.layer_name, self.kind, self.percentile = layer_name, observer, percentile
        self.tensor_obs: dict[str, Observer] = {}
        self.channel_obs: dict[str, Observer] = {}
        self.alias: dict[str, str] = {}  # linear → linear whose (identical) input it shares
        kv = kv_observer or observer
        self.attention = None if attention is None else _join(layer_name, attention)
        self.k_obs = self.v_obs = None
        if self.attention is not None:
            self.k_obs = self._make(f"{self.attention}.k_cache", "head", kv)
            self.v_obs = self._make(f"{self.attention}.v_cache", "head", kv)
        self._last_x: torch.Tensor | None = None
        self._last_name: str | None = None

    def _make(self, name: str, granularity: str, kind: str | None = None) -> Observer:
        kind = kind or self.kind
        kw = {"percentile": self.percentile} if kind == "percentile" else {}
        return make_observer(kind, name=name, granularity=granularity, **kw)

    def _observe(self, name: str, x: torch.Tensor) -> None:
        if name in self.alias:
            return
        if x is self._last_x:  # q/k/v (gate/up) read the same tensor: observe it once
            self.alias[name] = self._last_name
            return
        if name not in self.channel_obs:
            self.channel_obs[name] = make_observer("minmax", name=name, granularity="channel")
            if self.kind != "minmax":
                self.tensor_obs[name] = self._make(name, "tensor")
        self.channel_obs[name].update(x)
        if name in self.tensor_obs:
            self.tensor_obs[name].update(x)
        self._last_x, self._last_name = x, name

    def attach(self, layer: nn.Module) -> Callable[[], None]:
        """Register pre-hooks on every Linear of `layer`; returns the cleanup function."""
        handles = []
        for sub, mod in layer.named_modules():
            if isinstance(mod, nn.Linear):
                full = _join(self.layer_name, sub)
                handles.append(mod.register_forward_pre_hook(
                    lambda m, args, _n=full: self._observe(_n, args[0])))

        def cleanup():
            for h in handles:
                h.remove()
            self._last_x = self._last_name = None

        return cleanup

    def kv_hook(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, S, KV, hd] post-rotary."""
        self._last_x = None  # attention sits between the q/k/v and o_proj inputs
        self.k_obs.update(k)
        self.v_obs.update(v)

    def compute(self) -> dict[str, torch.Tensor]:
        """The layer's table entries (see calib/tables.py)."""
        out: dict[str, torch.Tensor] = {}
        for name, obs in self.channel_obs.items():
            ch = obs.compute().absmax.float()  # [K]
            out[f"{name}.{INPUT_CHANNEL_ABSMAX}"] = ch
            t = self.tensor_obs[name].compute().absmax if name in self.tensor_obs else ch.amax()
            out[f"{name}.{INPUT_ABSMAX}"] = t.float().reshape(())
        for name, src in self.alias.items():
            for suffix in (INPUT_CHANNEL_ABSMAX, INPUT_ABSMAX):
                out[f"{name}.{suffix}"] = out[f"{src}.{suffix}"].clone()
        if self.k_obs is None:
            return out
        if self.k_obs.num_updates == 0:
            raise QuantSpecError(f"{self.attention}: attention never ran (no K/V observed); the "
                                 "model's attention does not call the backend")
        out[f"{self.attention}.k_absmax"] = self.k_obs.compute().absmax.float()  # [KV]
        out[f"{self.attention}.v_absmax"] = self.v_obs.compute().absmax.float()
        return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def calibrate_model(model, input_ids: torch.Tensor, *, observer: str = "minmax",
                    percentile: float = DEFAULT_PERCENTILE, batch_size: int = DEFAULT_BATCH_SIZE,
                    weights: CheckpointReader | None = None, device=None, dtype: torch.dtype | None = None,
                    progress: Progress | None = None, kv_observer: str | None = None,
                    sink: PartSink | None = None) -> dict[str, torch.Tensor]:
    """Observe `model` (a `Transformer`) on input_ids [n, S] layer by layer → table tensors.
    `kv_observer` (default: `observer`) is the observer kind of the K/V per-head scales. A model
    on `meta` is read from `weights` one layer at a time onto `device`. Each layer's entries go
    to `sink` (default: kept in memory and returned); a sink holding some layers already (a
    resumed run) continues after them, from the inputs it kept."""
    for o in (observer, kv_observer or observer):
        if o not in OBSERVERS:
            raise QuantSpecError(f"observer {o!r} unknown; use one of: {', '.join(OBSERVERS)}")
    sink = sink if sink is not None else PartSink()
    L = len(model.model.layers)
    start = next((i for i in range(L) if layer_key(i) not in sink.done), L)
    if start == L:
        return sink.tensors
    runner = LayerRunner(model, input_ids, batch_size=batch_size, weights=weights, device=device,
                         dtype=dtype, progress=progress, start=start,
                         inputs=sink.inputs_for(start) if start else None)
    with torch.no_grad():
        for step in runner:
            obs = LayerObservers(step.name, observer, percentile, kv_observer)
            cleanup = obs.attach(step.layer)
            try:
                with all_experts(step.layer):  # every expert's input range from every token (model_zoo.moe)
                    step.forward(obs.kv_hook)
            finally:
                cleanup()
            sink.write(layer_key(step.index), obs.compute(), {},
                       inputs=step.outputs if step.index + 1 < L else None)
    return sink.tensors


def _load_for_calibration(model_dir: Path, cfg: dict, rotation=None):
    """(the model at `model_dir` (config.json `cfg`) on `meta`, its CheckpointReader: a quantized
    checkpoint's `quant.decompressed.DecompressedReader`; with `rotation`, read as the rotated
    model's, `calib.rotate.RotatedReader`)."""
    from quantspec.calib.rotate import RotatedReader, rotated_config
    from quantspec.model_zoo.checkpoint import build_model, check_checkpoint
    from quantspec.model_zoo.llama import ModelArgs
    from quantspec.quant.decompressed import source_reader

    reader = source_reader(model_dir, cfg)  # a quantized checkpoint: the float one it decompresses to
    cfg = rotated_config(rotation, cfg)
    args = ModelArgs.from_hf_config(cfg)
    net = build_model(args, "meta")
    if rotation is not None:
        reader = RotatedReader(reader, net, rotation)
    check_checkpoint(reader.shapes, args, str(model_dir))
    return net, reader


def calibration_batches(config: CalibrateConfig, tokenizer_dir: Path, say) -> torch.Tensor:
    """The calibration windows [num_samples, seq_len] of `config.dataset`, tokenized by the
    tokenizer at `tokenizer_dir`."""
    from transformers import AutoTokenizer

    from quantspec.calib.data import build_calibration_batches, load_calibration_texts

    say("reading the dataset")
    with about("--dataset"):
        texts = load_calibration_texts(config.dataset, split=config.split, text_field=config.text_field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # no tokenizer files: one line
        raise QuantSpecError(f"could not load the tokenizer of {tokenizer_dir} ({type(e).__name__}); "
                             "the model directory needs its tokenizer files") from None
    return build_calibration_batches(texts, tokenizer, config.num_samples, config.seq_len, seed=config.seed)


def run_calibration(config: CalibrateConfig, progress: Progress | None = None,
                    on_status: Callable[[str], None] | None = None) -> CalibrationResult:
    """Model + dataset → table directory `config.out` (see the module docstring); a draft
    module's table is measured on its base (`calib.draft_scales`)."""
    from quantspec.calib.quip import r4_block, turned_inputs
    from quantspec.calib.stream import open_run, say_resume
    from quantspec.devices import resolve_device
    from quantspec.model_zoo.checkpoint import draft_kind, read_config, resolve_model_dir

    t0, cpu0 = time.perf_counter(), time.process_time()
    say = on_status or (lambda msg: None)
    out = check_output_dir(config.out, "--out", overwrite=config.overwrite)
    device = resolve_device(config.device)
    with about("--model"):
        model_dir = resolve_model_dir(config.model)
        cfg = read_config(model_dir)
    if draft_kind(cfg) is not None:
        from quantspec.calib.draft_scales import calibrate_draft

        return calibrate_draft(config, model_dir, cfg, out, say, device)
    if config.base is not None:
        raise QuantSpecError(f"--base is a draft module's base and {model_dir} is not a draft module; drop --base")
    with about("--model"):  # every shard's header checked before any work
        net, reader = _load_for_calibration(model_dir, cfg, config.rotation)
    net.args.check_context(config.seq_len, "--seq-len")  # its windows run full attention
    if config.r4:
        r4_block(net)  # a model R4 cannot turn is refused here, before any work
    dtype_name = resolve_calibration_dtype(config.dtype)
    batches = calibration_batches(config, model_dir, say)  # [num_samples, seq_len]
    resumable, key = _run_identity(config, model_dir, reader, device, dtype_name)
    kv_observer = config.kv_observer or DEFAULT_KV_OBSERVER
    with open_run(out, key, resumable=resumable, restart=config.restart) as run, \
            turned_inputs(net, reader, config.r4) as reader:  # under R4, as the engine runs it
        sink = run.sink(keep_inputs=True)
        say_resume(sink, net.args.num_layers)
        say(f"calibrating on {config.num_samples} × {config.seq_len} tokens, one layer at a time ({device})")
        t1 = time.perf_counter()
        calibrate_model(net, batches, observer=config.observer, percentile=config.percentile,
                        batch_size=config.batch_size, weights=reader, device=device,
                        dtype=CALIBRATION_DTYPES[dtype_name], progress=progress, kv_observer=kv_observer, sink=sink)
        forward_s = time.perf_counter() - t1
        meta = _table_meta(config, dtype_name, kv_observer, model_dir, net, forward_s, cpu0)
        meta["wall_s"] = round(time.perf_counter() - t0, 3)
        path = write_table(out, run.tensors(), meta, overwrite=config.overwrite)
    return CalibrationResult(path=path, meta=meta, wall_s=meta["wall_s"], forward_s=forward_s)


def _run_identity(config: CalibrateConfig, model_dir: Path, reader, device: str, dtype_name: str) -> tuple[bool, str]:
    """(whether the run keeps a state to resume from, the key of everything its table depends on)."""
    from quantspec import __version__
    from quantspec.calib.stream import RESUMABLE_MIN_BYTES, file_stats, run_key

    skip = {"out", "overwrite", "restart", "resumable", "device"}
    identity = {"options": {k: v for k, v in asdict(config).items() if k not in skip}, "dtype": dtype_name,
                "model": file_stats(model_dir), "dataset": file_stats(config.dataset),
                "version": __version__, "device": torch.device(device).type}
    resumable = config.resumable
    if resumable is None:
        resumable = reader.nbytes() >= RESUMABLE_MIN_BYTES
    return bool(resumable), run_key(identity)


def _r4_meta(net) -> dict:
    """What a table calibrated under R4 records of it (`calib.rotate.check_table_rotation` reads it)."""
    from quantspec.calib.quip import r4_block
    from quantspec.calib.rotate import RUN_TIME_ROTATION

    return {"rotations": [RUN_TIME_ROTATION], "type": "hadamard", "head_dim": r4_block(net)}


def _table_meta(config: CalibrateConfig, dtype_name: str, kv_observer: str, model_dir: Path, net,
                forward_s: float, cpu0: float) -> dict:
    """calibration.json: the options, the data, the model (and the rotations fused into it) and
    how the run went."""
    return {
        **table_meta(config, dtype_name, kv_observer, model_dir, forward_s, cpu0),
        "rotation": None if config.rotation is None else config.rotation.to_meta(),
        "run_time_rotation": _r4_meta(net) if config.r4 else None,
        "num_layers": net.args.num_layers,
        "num_kv_heads": net.args.num_kv_heads,
    }


def table_meta(config: CalibrateConfig, dtype_name: str, kv_observer: str, model_dir: Path,
               forward_s: float, cpu0: float) -> dict:
    """What every calibration.json records: the options, the data, the model measured and how
    the run went."""
    from quantspec import __version__

    local = Path(config.dataset).expanduser()
    return {
        **{k: v for k, v in asdict(config).items() if k not in ("out", "overwrite", "restart", "resumable")},
        "dtype": dtype_name,
        "kv_observer": kv_observer,
        "dataset_path": str(local.resolve()) if local.exists() else None,
        "model_dir": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "quantspec_version": __version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "forward_s": round(forward_s, 3),
        "cpu_s": round(time.process_time() - cpu0, 3),
    }
