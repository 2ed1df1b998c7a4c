"""GPTQ or AWQ, W4A16 g64 on the default model (or one llm-compressor recipe file run by both
tools: `--recipe`): quantspec vs llm-compressor, same calibration tokens, same machine, one run;
prints wall time and held-out perplexity of both artifacts (quantspec reads the compressed-tensors
checkpoint llm-compressor writes).

    python -m venv --system-site-packages /tmp/lcvenv && /tmp/lcvenv/bin/pip install --no-deps llmcompressor
    python bench/ptq_vs_llmcompressor.py --llmcompressor-python /tmp/lcvenv/bin/python [--method gptq|awq]
        [--threads 2] [--weight-observers minmax,mse] [--recipe recipe.yaml]

Calibration: the texts of `bench/data/calib.jsonl` joined and cut into 64 × 512-token windows;
llm-compressor gets the token ids, quantspec a jsonl with one decoded window per row (its dataset
reader tokenizes again: the same text, up to BPE merges at the window edges). Held-out text:
`bench/data/heldout.txt` (never used for calibration). llm-compressor runs its defaults:
`GPTQModifier` (block 128, dampening 0.01, its static act-order) or `AWQModifier` (its Llama
mappings, duo scaling, 20-point grid, each mapping's loss on its parent module's output).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent

LC_SCRIPT = r'''
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import GPTQModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
if not torch.cuda.is_available():  # llm-compressor pins its activation cache, which needs a GPU
    torch.Tensor.pin_memory = lambda self, *a, **k: self
windows = json.load(open(sys.argv[2]))
L = len(windows[0])
ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * L for _ in windows]})
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=64))
if sys.argv[5].endswith((".yaml", ".yml", ".json")):  # a recipe file, as `quantspec quantize --recipe` reads it
    recipe = sys.argv[5]
elif sys.argv[5] == "gptq":
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128,
                          dampening_frac=0.01)
else:
    recipe = AWQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
t = time.perf_counter()
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=L, num_calibration_samples=len(windows))
print("PTQ_SECONDS", time.perf_counter() - t, flush=True)
model.save_pretrained(sys.argv[4], save_compressed=True)
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[4])
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llmcompressor-python", help="a python with llmcompressor installed (skipped if absent)")
    ap.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                    help="quantspec GPTQ with --act-order (its best g64 setting; llm-compressor runs its defaults)")
    ap.add_argument("--weight-observers", default="minmax,mse",
                    help="quantspec rows: one per weight observer (--weight-observer)")
    ap.add_argument("--recipe", help="an llm-compressor recipe file both tools run (quantspec: quantize --recipe), "
                                     "instead of --method's W4A16 g64")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from quantspec import api
    from quantspec.model_zoo.default import DEFAULT_MODEL, ensure_zoo_model

    model_dir = ensure_zoo_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in (HERE / "data" / "calib.jsonl").read_text().splitlines()
             if line.strip()]
    ids = tok("\n\n".join(texts)).input_ids
    n, L = a.num_samples, a.seq_len
    if len(ids) < n * L:
        raise SystemExit(f"calib.jsonl has {len(ids)} tokens, fewer than {n} x {L}")
    windows = [ids[i * L:(i + 1) * L] for i in range(n)]
    work = Path(tempfile.mkdtemp(prefix="ptq_bench_"))
    win_file = work / "windows.json"
    win_file.write_text(json.dumps(windows))
    # the same windows as text rows for quantspec's dataset reader (one window per row; each
    # re-tokenizes to ~the same tokens, and quantspec cuts/pads to seq_len)
    jsonl = work / "windows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": tok.decode(w)}) + "\n" for w in windows))

    rows = []
    if a.recipe:
        out = work / "quantspec-recipe"
        t = time.perf_counter()
        api.quantize(str(model_dir), out=out, recipe=a.recipe, dataset=str(jsonl), num_samples=n, seq_len=L,
                     overwrite=True)
        secs, flags = time.perf_counter() - t, api.inspect(out)["recipe"]["flags"]  # as the run recorded them
        rows.append((f"quantspec (--recipe: {' '.join(flags)})", secs, out))
    for obs in [o for o in a.weight_observers.split(",") if o and not a.recipe]:
        out = work / f"quantspec-{obs}"
        t = time.perf_counter()
        api.quantize(str(model_dir), "weight_only_int4", out, method=a.method, group_size=64, dataset=str(jsonl),
                     num_samples=n, seq_len=L, act_order=a.act_order and a.method == "gptq", weight_observer=obs,
                     overwrite=True)
        rows.append((f"quantspec (--weight-observer {obs})", time.perf_counter() - t, out))

    if a.llmcompressor_python and Path(a.llmcompressor_python).exists():
        script = work / "lc.py"
        script.write_text(LC_SCRIPT)
        lc_out = work / "llmcompressor"
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        t = time.perf_counter()
        res = subprocess.run([a.llmcompressor_python, str(script), str(model_dir), str(win_file), str(a.threads),
                              str(lc_out), str(Path(a.recipe).resolve()) if a.recipe else a.method],
                             capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        line = next((x for x in res.stdout.splitlines() if x.startswith("PTQ_SECONDS")), None)
        if res.returncode != 0 or line is None:
            print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
            raise SystemExit("llm-compressor run failed")
        rows.append(("llm-compressor", float(line.split()[1]), lc_out))
        print(f"(llm-compressor process wall incl. start-up and save: {wall:.1f} s)")

    heldout = HERE / "data" / "heldout.txt"
    fp32 = api.evaluate(str(model_dir), text_file=str(heldout), seq_len=512)["perplexity"]
    act_order = a.act_order and a.method == "gptq"
    what = f"the recipe {Path(a.recipe).name}" if a.recipe else f"{a.method.upper()} W4A16 g64"
    print(f"\n## {what}, {DEFAULT_MODEL}, {n} x {L} calibration tokens, {a.threads} thread(s)"
          f"{', quantspec act-order' if act_order and not a.recipe else ''}\n")
    print(f"| tool | {'quantize' if a.recipe else a.method.upper()} wall s | held-out ppl | vs fp32 |")
    print("|---|---:|---:|---:|")
    print(f"| fp32 | - | {fp32:.3f} | - |")
    for name, secs, path in rows:
        ppl = api.evaluate(str(path), text_file=str(heldout), seq_len=512)["perplexity"]
        print(f"| {name} | {secs:.1f} | {ppl:.3f} | {100 * (ppl / fp32 - 1):+.1f}% |")
    lc = next((r for r in rows if r[0] == "llm-compressor"), None)
    if lc is not None:
        for name, secs, _ in rows:
            if name != "llm-compressor":
                print(f"\n{name}: llm-compressor wall time / quantspec's = {lc[1] / secs:.2f}x")


if __name__ == "__main__":
    main()
