"""The user's verbs as Python functions: `infer`, `quantize`, `calibrate`, `evaluate`, `report`.

Each verb takes one typed config (or plain keyword arguments) and composes the wings below it
(`model_zoo`, `quant`, `calib`, `kernels`, `infer`, `report`); the CLI in `cli.py` only parses
flags into these calls and renders results. Python users call the same functions.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["infer"]


def infer(config, prompts: list[str] | None = None, *, data_file: str | Path | None = None,
          output_file: str | Path | None = None, on_text=None):
    """Generate for `prompts` or the `src` rows of a jsonl `data_file`.

    Returns (outputs, stats). With `output_file`, writes each input row plus `output` (text) and
    `output_token_ids`, atomically. `config` is an `infer.predictor.InferConfig`.
    """
    from quantspec.errors import QuantSpecError
    from quantspec.infer.predictor import Predictor, read_jsonl, write_jsonl

    if (prompts is None) == (data_file is None):
        raise QuantSpecError("give either a prompt or --data-file (not both)")
    rows = read_jsonl(data_file) if data_file is not None else [{"src": p} for p in prompts]
    predictor = Predictor(config)
    outs, stats = predictor.run([r["src"] for r in rows], on_text=on_text)
    if output_file is not None:
        write_jsonl(output_file, [dict(r, output=o.text, output_token_ids=o.token_ids) for r, o in zip(rows, outs)])
    return outs, stats
