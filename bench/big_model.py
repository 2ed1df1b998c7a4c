"""Models bigger than memory: wall time and peak resident memory of `quantize` / `calibrate` on
random-weight checkpoints with Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B layer shapes.

Each checkpoint is bf16, sharded into files of at most 2 GB with an index, as transformers writes
them, with vocabulary 49152 (the default model's tokenizer is copied in, so every command reads its
data as it would a real model's). Each command runs in a fresh process; its wall time and peak
resident memory (the child's `ru_maxrss`, i.e. VmHWM: file pages it mapped count too) are measured
from here. The checkpoint is built in a process of its own: a child's `ru_maxrss` starts at its
parent's peak (exec records the high-water mark of the memory it replaces, which a vfork'd child
shares with its parent), so this process stays small. A step is what one step of the stream must
hold: the largest decoder layer in float32 (what a layer is quantized in) plus, for commands with
data, the calibration activations of one layer (inputs and outputs, [n, S, hidden] float32 each)
and, for GPTQ, the layer's Hessians. The target of quantize / calibrate is 2 × step + 1 GB whatever
the depth; a peak ÷ step that stays put from 1B to 8B is peak memory that does not grow with depth,
and peak ÷ checkpoint shows what loading the whole model would have cost. `infer` loads the bf16
checkpoint as it is (no float32 copy) and decodes a few tokens: its target is the checkpoint +
1 GB, no second copy of the weights. `infer-int4` / `infer-int8` do the same on the int4 / int8
artifact (quantized first where the `int4` / `int8` command has not written it): the target is the
artifact + 1 GB, and the artifact's own size is the checkpoint column of that row.

Commands: `int8` (weight_only_int8, RTN), `int4` (weight_only_int4, RTN), `int4-gptq`
(weight_only_int4 --method gptq on --num-samples × --seq-len tokens of bench/data/calib.jsonl),
`fp8-int4-gptq` (the same from a block-FP8 artifact of the checkpoint, written first, whose weights
are decompressed a layer at a time),
`a8w8` (calibrate on those tokens, then quantize --quant-type a8w8 with its default recipe:
α search and the fallback under the error budget, every pass one layer at a time), `infer`,
`infer-int4`, `infer-int8`.

    python bench/big_model.py --models 1b --commands int8,int4,int4-gptq,a8w8,infer,infer-int4,infer-int8
    python bench/big_model.py --models 3b --commands int4-gptq
    python bench/big_model.py --models 8b --commands int8          # needs ≈ 40 GB of disk
    python bench/big_model.py --models 3b --commands int4-gptq --layers 2   # the same step, in minutes
    python bench/big_model.py --models 1b --commands int4-gptq,fp8-int4-gptq --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mdtable import markdown_table

# (hidden, intermediate, layers, heads, kv heads, head_dim, tied embeddings) of the models named
SHAPES = {
    "1b": ("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, True),
    "3b": ("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, True),
    "8b": ("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, False),
    "tiny": ("tiny", 128, 256, 3, 4, 2, 32, False),  # for the smoke test
}
VOCAB = 49152
COMMANDS = ("int8", "int4", "int4-gptq", "fp8-int4-gptq", "a8w8", "infer", "infer-int4", "infer-int8")
GB = 10**9
SHARD_BYTES = 2 * 10**9
BENCH_DIR = Path(__file__).resolve().parent
DATA = BENCH_DIR / "data" / "calib.jsonl"


def hf_config(key: str, layers: int | None = None) -> dict:
    """config.json of the shape `key` (with `layers` decoder layers instead of its own, if given)."""
    _, d, inter, depth, heads, kv, hd, tied = SHAPES[key]
    layers = layers or depth
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": d, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
            "tie_word_embeddings": tied, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
            "dtype": "bfloat16", "hidden_act": "silu"}


def build_checkpoint(key: str, out: Path, seed: int = 0, layers: int | None = None) -> Path:
    """A random-weight bf16 checkpoint of the shape `key` (`layers`: hf_config), sharded like
    transformers' own."""
    import torch

    from quantspec.model_zoo.checkpoint import resolve_model_dir
    from quantspec.model_zoo.llama import ModelArgs, hf_weight_table

    if (out / "model.safetensors.index.json").is_file():
        return out
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = hf_config(key, layers)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = resolve_model_dir("smollm2-135m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, tmp / f)
    g = torch.Generator().manual_seed(seed)
    shards, shard, size = [], {}, 0
    for name, shape in hf_weight_table(ModelArgs.from_hf_config(cfg)).items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        t = t.to(torch.bfloat16)
        if shard and size + t.numel() * 2 > SHARD_BYTES:
            shards.append(shard)
            save_file(shard, str(tmp / f"shard-{len(shards)}.safetensors"))
            shard, size = {}, 0
        shard[name], size = t, size + t.numel() * 2
    shards.append(shard)
    save_file(shard, str(tmp / f"shard-{len(shards)}.safetensors"))
    n, weight_map = len(shards), {}
    for i, names in enumerate(shards, 1):
        f = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.rename(tmp / f"shard-{i}.safetensors", tmp / f)
        weight_map.update({k: f for k in names})
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    os.rename(tmp, out)
    return out


def build_apart(key: str, out: Path, env: dict, layers: int | None = None) -> Path:
    """`build_checkpoint` in a process of its own (module docstring: this one's peak would be
    every command's)."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from big_model import build_checkpoint; "
            "build_checkpoint(sys.argv[2], Path(sys.argv[3]), layers=int(sys.argv[4]) or None)")
    subprocess.run([sys.executable, "-c", code, str(BENCH_DIR), key, str(out), str(layers or 0)], env=env,
                   check=True)
    return out


def step_bytes(key: str, tokens: int, hessians: bool = False) -> tuple[int, int]:
    """(largest decoder layer in float32, one layer's inputs + outputs for `tokens` in float32, plus
    with `hessians` GPTQ's Hessians of one layer in float32: q/k/v's and gate/up's [D, D], o_proj's
    [H·hd, H·hd], down_proj's [I, I])."""
    _, d, inter, _, heads, kv, hd, _ = SHAPES[key]
    layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * inter + 2 * d
    h = 2 * d * d + (heads * hd) ** 2 + inter * inter if hessians else 0
    return layer * 4, (2 * tokens * d + h) * 4


def safetensors_bytes(model_dir: Path) -> int:
    """The bytes of a model directory's safetensors files (its weights)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def run(argv: list[str], env: dict) -> tuple[float, int]:
    """Run `quantspec ARGV` in a fresh process → (wall seconds, peak resident bytes)."""
    cmd = [sys.executable, "-c", "from quantspec.cli import main; main()", *argv]
    # the child's stderr goes to a file: a pipe nobody reads while we wait would stall a child
    # that prints more than the pipe holds (progress of a deep model)
    with tempfile.TemporaryFile("w+") as err_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err_file.seek(0)
        err = err_file.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"quantspec {' '.join(argv)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def commands(name: str, ckpt: Path, work: Path, a) -> list[tuple[str, list[str], int, bool, Path | None]]:
    """[(label, argv, calibration tokens, whether GPTQ's Hessians are resident, the model an `infer`
    row loads or None)] of the command `name`."""
    data = ["--dataset", str(a.data), "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len)]
    q = ["quantize", "--model", str(ckpt), "--device", a.device, "--overwrite"]
    tokens = a.num_samples * a.seq_len
    if name in ("int8", "int4"):
        return [(f"quantize {name}", [*q, "--quant-type", f"weight_only_{name}", "--out", str(work / name)], 0,
                 False, None)]
    if name == "int4-gptq":
        return [("quantize int4 gptq", [*q, "--quant-type", "weight_only_int4", "--method", "gptq", *data,
                                        "--out", str(work / "int4-gptq")], tokens, True, None)]
    if name == "fp8-int4-gptq":  # a block-FP8 source, as FP8 releases ship, decompressed a layer at a time
        fp8 = work / "fp8"
        first = [] if (fp8 / "config.json").is_file() else [
            ("quantize fp8 block", [*q, "--quant-type", "a8w8_fp8", "--weight-block", "128", "--out", str(fp8)], 0,
             False, None)]
        return [*first, ("quantize int4 gptq from fp8",
                         ["quantize", "--model", str(fp8), "--device", a.device, "--overwrite", "--quant-type",
                          "weight_only_int4", "--method", "gptq", *data, "--out", str(work / name)], tokens, True, None)]
    infer = ["infer", "--device", a.device, "--prompt", "Hello", "--no-chat-template", "--max-new-tokens", "4"]
    if name == "infer":
        return [("infer bf16", [*infer, "--model", str(ckpt)], 0, False, ckpt)]
    if name.startswith("infer-"):
        kind = name.split("-", 1)[1]
        first = [] if (work / kind / "config.json").is_file() else commands(kind, ckpt, work, a)
        return [*first, (f"infer {kind}", [*infer, "--model", str(work / kind)], 0, False, work / kind)]
    table = work / "table"
    return [("calibrate", ["calibrate", "--model", str(ckpt), "--device", a.device, "--overwrite", *data,
                           "--out", str(table)], tokens, False, None),
            ("quantize a8w8", [*q, "--quant-type", "a8w8", "--calib", str(table), "--dataset", str(a.data),
                               "--seq-len", str(a.seq_len), "--out", str(work / "a8w8")], 4 * a.seq_len, False, None)]


def measure(model: str, label: str, argv: list[str], tokens: int, hessians: bool, ckpt_bytes: int,
            env: dict, loads: Path | None = None, layers: int | None = None) -> dict:
    """One row: the command's wall time and peak, against its target (quantize / calibrate: 2 × one
    stream step + 1 GB; infer: the model it `loads` + 1 GB, i.e. no second copy of the weights)."""
    wall, peak = run(argv, env)
    layer, acts = step_bytes(model, tokens, hessians)
    step = layer + acts
    if loads is not None:
        ckpt_bytes = safetensors_bytes(loads)
    target = (ckpt_bytes if loads is not None else 2 * step) + GB
    name = SHAPES[model][0] + (f" ({layers} layers)" if layers else "")
    return {"model": name, "command": label, "wall_s": round(wall, 1),
            "peak_gb": round(peak / 1e9, 2), "checkpoint_gb": round(ckpt_bytes / 1e9, 2),
            "step_gb": round(step / 1e9, 2), "ratio": round(peak / step, 2),
            "peak_over_checkpoint": round(peak / ckpt_bytes, 2), "target_gb": round(target / 1e9, 2),
            "within_target": peak <= target}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,3b", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--commands", default=",".join(COMMANDS), help=f"comma-separated: {', '.join(COMMANDS)}")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dir", default="/tmp/quantspec-big-model", help="checkpoints and outputs go here")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of each shape (default: its own); a step does not depend on depth")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    models, names = a.models.split(","), a.commands.split(",")
    bad = [m for m in models if m not in SHAPES] + [c for c in names if c not in COMMANDS]
    if bad:
        raise SystemExit(f"unknown model or command {bad[0]!r}; models: {', '.join(SHAPES)}; commands: "
                         f"{', '.join(COMMANDS)}")
    root = Path(a.dir)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    rows = []
    for m in models:
        depth = f"-{a.layers}layers" if a.layers else ""
        ckpt = build_apart(m, root / f"{SHAPES[m][0]}{depth}-random", env, layers=a.layers)
        ckpt_bytes = safetensors_bytes(ckpt)
        work = root / f"{m}-out"
        for name in names:
            for label, argv_, tokens, hessians, loads in commands(name, ckpt, work, a):
                rows.append(measure(m, label, argv_, tokens, hessians, ckpt_bytes, env, loads, a.layers))
                print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    print(markdown_table(["model", "command", "wall s", "peak GB", "checkpoint GB", "step GB", "peak ÷ step",
                          "peak ÷ checkpoint", "target GB", "within"],
                         [[r["model"], r["command"], r["wall_s"], r["peak_gb"], r["checkpoint_gb"], r["step_gb"],
                           r["ratio"], r["peak_over_checkpoint"], r["target_gb"], "yes" if r["within_target"] else "NO"]
                          for r in rows], "llrrrrrrrl"))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
