"""`quantize --quant-type keep`: a compressed-tensors artifact whose weights are copied as they are,
with the static KV-cache scales of a calibration table added (`--calib T --kv-cache fp8|int8`, or
`--dataset D` to measure the table on the artifact in the run, as `calib.oneshot` does for quantize).

This is how an artifact written without KV-cache scales (by llm-compressor, by quantspec without
`--kv-cache`) gets them without re-quantizing its weights, which would round them a second time.
The table is checked against the artifact's model (`calib.tables.read_table`; `calibrate --model
ARTIFACT` measures one on the artifact itself, read as the float checkpoint it decompresses to).
Every tensor but the KV scales is copied byte for byte; `quantization_config` is the source's with
its `kv_cache_scheme` set (an earlier one replaced); the provenance is the source's, with the
calibration and the KV cache added. Written atomically, as every artifact.
"""

from __future__ import annotations

from pathlib import Path

from quantspec.errors import QuantSpecError, about

__all__ = ["KEEP", "run_keep"]

KEEP = "keep"
# the one-shot table's data options (`calib.oneshot`), as quantize takes them
_DATA = ("dataset", "split", "text_field", "num_samples", "seq_len", "seed")
# what `--quant-type keep` reads; every other option of `QuantizeConfig` must stay at its default
_KEPT_OPTIONS = ("model", "quant_type", "out", "calib", "kv_cache", "kv_strategy", "target", "compute_capability",
                 "overwrite", "device", *_DATA)


def _check_options(options: dict) -> None:
    from dataclasses import fields

    from quantspec.calib.quantize import QuantizeConfig

    defaults = {f.name: f.default for f in fields(QuantizeConfig) if f.init}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise QuantSpecError(f"quantize: unexpected option {unknown[0]!r}")
    for name, value in options.items():
        if name not in _KEPT_OPTIONS and value != defaults[name]:
            flag = "--" + name.replace("_", "-")
            raise QuantSpecError(f"--quant-type keep copies the artifact's quantized weights as they are, so {flag} "
                                 "does not apply; drop it, or quantize the model with a --quant-type")
    if options.get("kv_cache") is None or (options.get("calib") is None and options.get("dataset") is None):
        raise QuantSpecError("--quant-type keep adds KV-cache scales to an artifact: pass --kv-cache fp8|int8 and "
                             "--calib DIR (from `quantspec calibrate --model ARTIFACT`) or --dataset D to calibrate "
                             "in this run")
    if options.get("calib") is not None and options.get("dataset") is not None:
        raise QuantSpecError("--quant-type keep takes its KV scales from --calib, and --dataset would measure them "
                             "again; drop one")
    return defaults


def _kv_args(kind: str, strategy: str | None, target: str, compute_capability=None):
    """The KV-cache args of `--kv-cache kind --kv-strategy strategy`, refused where `target` would (on
    a GPU of `compute_capability` where given)."""
    from quantspec.quant.engines import parse_capability, target_refusal
    from quantspec.quant.presets import KV_STRATEGIES, preset, settle_kv_strategy

    strategy = settle_kv_strategy(target, strategy)
    probe = preset("weight_only_int8", kv_cache=kind, kv_strategy=KV_STRATEGIES[strategy])
    capability = None if compute_capability is None else parse_capability(compute_capability)
    refusal = target_refusal(target, probe, capability=capability)
    if refusal is not None:
        raise QuantSpecError(refusal)
    return probe.kv_cache_scheme


def _source(model: str):
    """(directory, config.json, its QuantConfig) of a compressed-tensors artifact."""
    from quantspec.model_zoo.checkpoint import read_config, resolve_model_dir, verify_checkpoint
    from quantspec.quant.config import QuantConfig

    with about("--model"):
        d = resolve_model_dir(model)
        cfg = read_config(d)
        qd = cfg.get("quantization_config")
        if not qd:
            raise QuantSpecError(f"{d} is not quantized; --quant-type keep adds KV-cache scales to an artifact "
                                 "(quantize this model with a --quant-type and --kv-cache)")
        qc = QuantConfig.from_dict(qd)
        if qc.source is not None or qc.tensor_names:
            raise QuantSpecError(f"{d} is a {qd.get('quant_method')!r} checkpoint, which keeps no KV-cache scheme "
                                 "that engines read; quantize it to its own scheme (e.g. a8w8_fp8 --weight-block "
                                 "128) with --kv-cache instead")
        verify_checkpoint(d)
    return d, cfg, qc


def run_keep(options: dict, say=lambda _m: None) -> Path:
    """The artifact at `options["out"]`: the source's tensors and the table's KV scales (module docstring)."""
    from quantspec.calib.stream import open_run
    from quantspec.outputs import check_output_dir

    defaults = _check_options(options)
    if options.get("out") is None:
        raise QuantSpecError("--out is required: the directory to write the artifact to")
    out = check_output_dir(options["out"], "--out", overwrite=bool(options.get("overwrite")))
    kv = _kv_args(options["kv_cache"], options.get("kv_strategy"), options.get("target", "portable"),
                  options.get("compute_capability"))
    d, cfg, qc = _source(options["model"])
    with open_run(out, KEEP, resumable=False) as run:  # its working directory goes however the run ends
        return _keep(options, defaults, out, kv, (d, cfg, qc), run, say)


def _keep(options: dict, defaults: dict, out: Path, kv, source: tuple, run, say) -> Path:
    """`run_keep`'s artifact from the source (directory, config.json, QuantConfig), written through the
    run's working directory (`calib.stream.Run`), which also holds a one-shot table."""
    from quantspec import __version__
    from quantspec.calib.calibrate import CalibrateConfig, run_calibration
    from quantspec.calib.quantize import COPIED_FILES
    from quantspec.calib.tables import read_table
    from quantspec.model_zoo.checkpoint import CheckpointReader
    from quantspec.quant.artifact import read_provenance, write_artifact

    d, cfg, qc = source
    calib = options.get("calib")
    if calib is None:  # one-shot: the table measured on the artifact itself
        data = {k: options.get(k, defaults[k]) for k in _DATA}
        say(f"calibrating {d} on {data['num_samples']} × {data['seq_len']} tokens of {data['dataset']}")
        run_calibration(CalibrateConfig(model=str(d), out=str(run.dir / "calibration"),
                                        device=options.get("device", "auto"), **data), on_status=say)
    with about("--calib"):
        table = read_table(run.dir / "calibration" if calib is None else calib, model_dir=d)
    ranges = CheckpointReader(d).ranges
    kept = [n for n in ranges if not n.endswith((".k_scale", ".v_scale"))]  # an earlier KV scheme's are replaced
    say(f"copying the quantized weights of {d} and adding {options['kv_cache']} KV-cache scales")
    cfg = {**cfg, "quantization_config": {**cfg["quantization_config"], "kv_cache_scheme": kv.to_dict()}}
    meta = read_provenance(d)
    provenance = {**(meta.get("provenance") or {}), "kv_cache": options["kv_cache"],
                  "kv_calibration": {"calib": None if calib is None else str(calib), "quantspec_version": __version__,
                                     **table.meta}}
    extra = {f: d / f for f in COPIED_FILES if (d / f).is_file()}
    writer = run.writer
    for f in dict.fromkeys(ranges[n].path for n in kept):  # a part per source file: bytes copied, not loaded
        writer.add(str(f), {n: ranges[n] for n in kept if ranges[n].path == f})
    writer.add("kv", table.kv_artifact_tensors(options["kv_cache"], kv.strategy))
    return write_artifact(out, writer, cfg, extra_files=extra, overwrite=bool(options.get("overwrite")),
                          provenance={"quant_type": meta.get("quant_type") or getattr(qc.quant_type, "value", None),
                                      "provenance": provenance})
