"""Decode speed: quantspec's engine vs transformers `generate` on the default model, one run,
same prompt, same machine; batch 1 and batch 8; prints tokens/s and the ratios.

    python bench/decode.py [--prompt-tokens 600] [--new-tokens 256] [--threads N] [--quant int8,int4] [--rounds 3]

`--quant` adds rows for quantized artifacts of the same model (built with `quantspec.api.quantize`
into a cache directory, RTN) so their tokens/s can be compared with fp32 in the same run: fp32 and
each artifact run in turn, `--rounds` times, and the medians are compared.

Last, batch 1 of fp32 and of each artifact as loaded — the layer stack in one C++ call
(`infer/cpu/stack.py`) and greedy ids from the int8 / bf16 screen of the head
(`infer/cpu/greedy.py`), both from the loaded model's runtime — then with full logits, then
through the Python modules (the same kernels, called one by one), interleaved `--rounds` times:
decode-phase medians, the ratio to the modules, and whether all gave the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams


def _prompt_ids(tokenizer, n: int) -> list[int]:
    text = ("The history of the lighthouse is a story of engineering, weather and people. " * 200)
    return tokenizer(text).input_ids[:n]


def bench_engine(loaded, prompt, new_tokens, batch, outputs: list | None = None, runtime=None) -> tuple[float, float]:
    """→ (end-to-end tokens/s, decode-phase tokens/s after the batch's prefill steps) of the
    `LoadedModel` on its runtime (or `runtime`); the sequences' token ids are appended to
    `outputs` when given."""
    eng = Engine(loaded.model, EngineConfig(max_batch_size=batch, max_length=len(prompt) + new_tokens + 8),
                 eos_token_ids=[], runtime=runtime or loaded.runtime)
    seqs = [eng.add_request(prompt, SamplingParams(max_new_tokens=new_tokens)) for _ in range(batch)]
    t = time.perf_counter()
    while any(s.num_cached == 0 for s in seqs):  # the prefill steps (+ each first token)
        eng.step()
    t_prefill = time.perf_counter()
    eng.run()
    dt = time.perf_counter() - t
    total = sum(len(s.output_ids) for s in seqs)
    if outputs is not None:
        outputs.append([list(s.output_ids) for s in seqs])
    return total / dt, (total - batch) / (time.perf_counter() - t_prefill)


def held_mib(model) -> float:
    """MiB of the tensors a loaded model holds (parameters and buffers, each storage once): the
    weights in the layouts its kernels read."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t is not None and t.device.type == "cpu":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) / 2**20


def bench_hf(hf, prompt, new_tokens, batch) -> float:
    ids = torch.tensor([prompt] * batch)
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    return (out.shape[1] - len(prompt)) * batch / dt


def _artifacts(model_dir, quant: str) -> list:
    """(quant type, LoadedModel) of each `--quant` artifact of the default model (built once with
    RTN into the cache, loaded with `--dtype auto`)."""
    from quantspec import api
    from quantspec.infer.loader import auto_dtype, load_for_inference
    from quantspec.model_zoo.default import DEFAULT_MODEL, cache_dir

    quants = []
    for qt in [q for q in quant.split(",") if q]:
        qt = {"int8": "weight_only_int8", "int4": "weight_only_int4"}.get(qt, qt)
        out = cache_dir() / "bench" / f"{DEFAULT_MODEL}.{qt}"
        if not (out / "config.json").exists():
            api.quantize(str(model_dir), qt, out, overwrite=True, target="quantspec")  # MXFP4 too
        quants.append((qt, load_for_inference(out, dtype=auto_dtype(out))))
    return quants


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quant", default="", help="comma list of quant types (int8, int4: weight_only_int8 / int4)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved fp32 / quant rounds (medians)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from quantspec.infer.loader import load_for_inference
    from quantspec.model_zoo.default import DEFAULT_MODEL, ensure_zoo_model

    model_dir = ensure_zoo_model(DEFAULT_MODEL)
    loaded = load_for_inference(model_dir)
    prompt = _prompt_ids(loaded.tokenizer, a.prompt_tokens)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batches = [int(b) for b in a.batches.split(",")]
    rows = []
    for b in batches:
        ours, decode = bench_engine(loaded, prompt, a.new_tokens, b)
        theirs = bench_hf(hf, prompt, a.new_tokens, b)
        rows.append((f"fp32 batch {b}", ours, theirs, decode))
    base_b1 = rows[0][1]
    quant_rows = []
    quants = _artifacts(model_dir, a.quant)
    if quants:
        # fp32 and every quant type in turn, `--rounds` times: load on a shared machine hits all
        # alike; the medians are reported (fp32's row above is the first round's)
        runs = {name: [] for name in ["fp32"] + [qt for qt, _ in quants]}
        for _ in range(a.rounds):
            runs["fp32"].append(bench_engine(loaded, prompt, a.new_tokens, 1))
            for qt, qloaded in quants:
                runs[qt].append(bench_engine(qloaded, prompt, a.new_tokens, 1))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
        base_b1, base_decode = med["fp32"]
        quant_rows = [(qt, *med[qt], held_mib(q.model)) for qt, q in quants]

    print(f"\n## decode: {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads\n")
    print("| run | quantspec tok/s | transformers tok/s | ratio | quantspec decode-phase tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name, ours, theirs, decode in rows:
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {decode:.1f} |")
    if len(rows) > 1:
        print(f"\nbatch {batches[-1]} / batch {batches[0]} throughput (quantspec): end to end "
              f"{rows[-1][1] / base_b1:.2f}x, decode phase {rows[-1][3] / rows[0][3]:.2f}x")
    if quant_rows:
        print(f"\nartifacts vs fp32, batch 1, median of {a.rounds} interleaved rounds "
              f"(fp32: {base_b1:.1f} tok/s, decode phase {base_decode:.1f}, {held_mib(loaded.model):.0f} MiB held)\n")
        print("| quant type (batch 1, --dtype auto) | tok/s | vs fp32 | decode-phase tok/s | vs fp32 | MiB held |")
        print("|---|---:|---:|---:|---:|---:|")
        for qt, tps, decode, mib in quant_rows:
            print(f"| {qt} | {tps:.1f} | {tps / base_b1:.2f}x | {decode:.1f} | {decode / base_decode:.2f}x | {mib:.0f} |")
    fused_ab([("fp32", loaded)] + quants, prompt, a.new_tokens, a.rounds)


def fused_ab(models, prompt, new_tokens, rounds) -> None:
    """Batch 1 as loaded (one-call layer stack + greedy head where they apply), without the greedy
    head (full fp32 logits), and through the modules with full logits; interleaved per round."""
    rows = []
    for name, loaded in models:
        runtime = loaded.runtime
        runner, head = runtime.stack, runtime.greedy
        if runner is None and head is None:
            print(f"\n{name}: no one-call layer stack or greedy head here (infer/cpu/stack.py, greedy.py)")
            continue
        modes = {"default": runtime, "logits": dataclasses.replace(runtime, greedy=None),
                 "modules": dataclasses.replace(runtime, stack=None, greedy=None)}
        runs = {m: [] for m in modes}
        outs = {m: [] for m in modes}
        for _ in range(rounds):
            for mode, rt in modes.items():
                runs[mode].append(bench_engine(loaded, prompt, new_tokens, 1, outs[mode], runtime=rt))
        med = {m: statistics.median(r[1] for r in v) for m, v in runs.items()}
        same = all(o == outs["default"][0] for v in outs.values() for o in v)
        rows.append((name, med, same, runner is not None, head is not None))
    if rows:
        print(f"\ndecode-phase tok/s, batch 1, median of {rounds} interleaved rounds: as loaded (one-call "
              f"layer stack, greedy head), with full logits, and through the modules\n")
        print("| model | stack + greedy head | stack, full logits | modules, full logits | vs modules | same tokens |")
        print("|---|---:|---:|---:|---:|:---:|")
        for name, med, same, has_stack, has_head in rows:
            d, lg, m = med["default"], med["logits"], med["modules"]
            print(f"| {name} | {d:.1f}{'' if has_head else ' (no head)'} | {lg:.1f} | {m:.1f} | {d / m:.2f}x | "
                  f"{'yes' if same else 'NO'} |")

if __name__ == "__main__":
    main()
