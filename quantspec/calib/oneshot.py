"""One-shot calibration: `quantize --dataset D` without `--calib` measures the table its run needs.

A quantize run reads a calibration table (`calib.tables`) for static a8w8 / a8w8_fp8 input scales,
NVFP4's input global scales, `--kv-cache` scales and SmoothQuant's channel ranges for inputs
quantized per token. `--calib T` names one `quantspec calibrate` wrote (reusable across runs and
quant types); without it, `--dataset D` has the run measure its own first, as llm-compressor's
`oneshot` calibrates and quantizes in one call: `calibrate` on the same model (a draft module on
its base, `--base`), data (`--dataset`, `--split`, `--text-field`, `--num-samples`, `--seq-len`,
`--seed`), rotations (`--rotate`) and device, with calibrate's defaults for the rest (min/max
input ranges, mse K/V ranges).

The table is written into the run's working directory (`calib.stream.open_run`), so it goes when
the run ends however it ends, and a resumable run that was interrupted keeps it (and calibrate's
own state) for the command that resumes it. The artifact's `quantspec.json` records the table's
metadata under `calibration`, as for `--calib`, with `calib` null.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from quantspec.errors import QuantSpecError, about

__all__ = ["TABLE_DIR", "attach_table", "calibrate_in_run", "needs_table", "one_shot", "refuse_missing_table"]

TABLE_DIR = "calibration"  # the one-shot table, in the run's working directory


def needs_table(c) -> bool:
    """Whether the quantize run `c` (a `calib.quantize.QuantizeConfig`) reads a calibration table."""
    from quantspec.calib.recipe_checks import smooths_per_token

    return c.calibrated_inputs or c.kv_cache is not None or smooths_per_token(c)


def one_shot(c) -> bool:
    """Whether the run `c` measures its own table (`--dataset` and no `--calib`, module docstring)."""
    return c.calib is None and c.dataset is not None and needs_table(c)


def refuse_missing_table(c, what: str) -> None:
    """Refuse, naming both ways to a table, the run `c` that needs one for `what` and has neither."""
    if c.calib is None and c.dataset is None:
        raise QuantSpecError(f"{what}; pass --dataset D to calibrate in this run, or --calib DIR from "
                             f"`quantspec calibrate --model {c.model} --dataset D --out DIR`")


def attach_table(c, src, path: str | Path, model_dir: Path) -> None:
    """Read the table at `path` into `src.table` (a `calib.quantize._Source`) for the run `c`,
    checked against the model and the run's rotations, and record it in the provenance."""
    from quantspec.calib.recipe_checks import smooths_per_token
    from quantspec.calib.rotate import check_table_rotation
    from quantspec.calib.tables import read_table

    with about("--calib"):
        src.table = read_table(path, model_dir=model_dir)
        ranges = c.calibrated_inputs or smooths_per_token(c)  # its input ranges are read
        check_table_rotation(c.rotation, path, src.table, r4=c.r4, ranges=ranges)
    src.calib_summary.update(calib=None if one_shot(c) else str(path), calibration=src.table.meta,
                             kv_cache=c.kv_cache)


def calibrate_in_run(c, src, run, say: Callable[[str], None], progress=None) -> None:
    """Measure the table of the run `c` into its working directory `run.dir` (kept there by an
    interrupted resumable run, and then reused) and attach it to `src`."""
    from quantspec.calib.calibrate import CalibrateConfig, run_calibration

    path = run.dir / TABLE_DIR
    if not (path / "calibration.json").is_file():
        say(f"calibrating on {c.num_samples} × {c.seq_len} tokens of {c.dataset} (no --calib given)")
        run_calibration(CalibrateConfig(model=c.model, dataset=c.dataset, out=str(path), split=c.split,
                                        text_field=c.text_field, num_samples=c.num_samples, seq_len=c.seq_len,
                                        seed=c.seed, device=c.device, rotate=c.rotate, base=c.base,
                                        overwrite=True),
                        progress=progress, on_status=say)
    attach_table(c, src, path, src.model_dir)
