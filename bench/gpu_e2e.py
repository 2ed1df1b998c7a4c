"""End to end on a GPU: a random-weight Llama-3-8B-shaped model built on the device in bf16,
quantized by quantspec (RTN; a8w8 / a8w8_fp8 with static activation scales calibrated on random
tokens), run by quantspec's engine; decode tokens/s beside the bf16 model in the same run.

    python bench/gpu_e2e.py [--out DIR] [--quant bf16,int4,int4std,int8,fp8,a8w8] [--batch 1,32]
                            [--layers 32] [--prompt-tokens 256] [--new-tokens 64] [--budget-s 300]
    python bench/gpu_e2e.py --device cpu            # tiny shapes on the CPU engine (smoke)

Per model: decode-phase tokens/s at each batch size (decode steps replay CUDA graphs; bf16 and
the speculation model also with their layers' small ops as torch's ops instead of fused kernels,
`DispatchPolicy.cuda_fused_ops=False`, and without CUDA graphs, at batch 1); for int4 also a
long context (`--long-context` tokens of prompt), the attention with its keys split across
programs (`DispatchPolicy.cuda_split_kv`) at both lengths, a static int8 and
fp8 KV cache, n-gram speculation on prompts that repeat themselves (`inference_with_reference`,
with the back-off and without, at batch 1 and 4; a random model rarely continues its prompt, so
this measures what speculation costs when it is not accepted), and the verification cost
C(k) = time of a step verifying k drafts / a plain step (what the back-off's `SpecCost` models),
from which the speedup of speculation at an acceptance rate follows. For bf16 and the speculation
model a profile of replayed decode steps at batch 1: the kernels by time per step, and the share
of the step the device is busy, and, on a GPU of compute capability 9.0 or more, decode with the
stack's kernels as programmatic dependent launches (`DispatchPolicy.cuda_pdl`). int4std is the
int4 model with its codes in the standard layout (`DispatchPolicy.cuda_int4_quartered` off),
beside int4 in the default quartered one.

Every measurement is appended to `e2e.jsonl` as it finishes, so a time-boxed run keeps what it
measured; once `--budget-s` has passed the rest is recorded as skipped. `e2e.md` holds the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3.1-8B: vocabulary 128256, hidden 4096, MLP 14336, 32 layers, 32 heads / 8 KV heads
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                 num_kv_heads=1, max_position_embeddings=1024),
}
QUANTS = {"int4": "weight_only_int4", "int4std": "weight_only_int4", "int8": "weight_only_int8", "a8w8": "a8w8",
          "fp8": "a8w8_fp8"}
# a model's dispatch policy where it is not the default's: int4std is int4 with its codes in the
# standard layout (`DispatchPolicy.cuda_int4_quartered` off)
POLICIES = {"int4std": dict(cuda_int4_quartered=False)}


class Run:
    """The run's clock, device and results file."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "e2e.jsonl"
        self.jsonl.write_text("")
        self.rows: list[dict] = []

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def record(self, **row) -> None:
        row["t_s"] = round(time.perf_counter() - self.t0, 1)
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print("  " + json.dumps(row), flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def model_args(run: Run):
    from quantspec.model_zoo.llama import ModelArgs

    shape = dict(SHAPES["8b" if run.device.type == "cuda" else "tiny"])
    if run.args.layers:
        shape["num_layers"] = run.args.layers
    return ModelArgs(**shape)


def make_net(run: Run, args, seed: int = 0):
    """The random-weight float model on the device (same weights for the same seed)."""
    from quantspec.model_zoo.checkpoint import build_model

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(run.dtype)
    try:
        net = build_model(args, device=run.device)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    net.setup_rope(args.max_position_embeddings, run.device)
    return net.eval()


def calibrate(run: Run, net, args) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Static scales from one forward over random tokens: each Linear's input abs-max, and per
    layer and KV head the keys' / values' abs-max → (input abs-max by name, k_amax, v_amax)."""
    from quantspec.model_zoo.llama import DenseCausalAttention

    amax: dict[str, float] = {}
    hooks = []
    for name, mod in net.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
            def hook(m, inp, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), float(inp[0].abs().max()))
            hooks.append(mod.register_forward_hook(hook))
    L, KV = args.num_layers, args.num_kv_heads
    k_amax = torch.zeros(L, KV)
    v_amax = torch.zeros(L, KV)

    def kv_hook(i, k, v):  # [B, S, KV, hd]
        k_amax[i] = torch.maximum(k_amax[i], k.abs().amax(dim=(0, 1, 3)).float().cpu())
        v_amax[i] = torch.maximum(v_amax[i], v.abs().amax(dim=(0, 1, 3)).float().cpu())

    B, S = 2, 128
    ids = torch.randint(args.vocab_size, (B * S,), device=run.device)
    pos = torch.arange(S, device=run.device).repeat(B)
    with torch.inference_mode():
        net(ids, pos, DenseCausalAttention(B, S, kv_hook))
    for h in hooks:
        h.remove()
    return amax, k_amax, v_amax


def policy_of(quant: str):
    """The `DispatchPolicy` a model of `quant` is loaded and run with."""
    from quantspec.infer.dispatch import DispatchPolicy

    return DispatchPolicy(**POLICIES.get(quant, {}))


def quantized(run: Run, args, quant: str, amax: dict):
    """(model, seconds to quantize) of `quant` from a fresh copy of the float model."""
    from quantspec.calib.ptq import quantize_model
    from quantspec.infer.loader import quantized_model
    from quantspec.quant.presets import preset

    net = make_net(run, args)
    qt = QUANTS[quant]
    qconfig = preset(qt, weight_observer="minmax")
    scales = None
    if qt in ("a8w8", "a8w8_fp8"):
        qmax = 127.0 if qt == "a8w8" else 448.0
        scales = {n: torch.tensor(max(a, 1e-6) / qmax) for n, a in amax.items()}
    run.sync()
    t = time.perf_counter()
    res = quantize_model(net, qconfig, "rtn", input_scales=scales, scale_dtype=run.dtype, out_dtype=run.dtype)
    run.sync()
    seconds = time.perf_counter() - t
    del net
    qnet, _, _ = quantized_model(res.tensors, args, res.config, dtype=run.dtype, device=run.device,
                                 policy=policy_of(quant), where=f"random {quant}")
    del res
    _free()
    return qnet, seconds


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_speed(run: Run, net, runtime, batch: int, *, kv=None, proposer=None, k=0, prompts=None,
                 prompt_tokens: int | None = None) -> dict:
    """Decode-phase tokens/s of `batch` sequences (after their prefill), greedy; first a warm-up
    run of the same requests, so that the step shapes the timed run meets have their CUDA graphs
    (a shape met for the first time pays for its capture). → {tok_s, accepted, drafted, step_ms:
    the median decode step, host_ms: its median time outside the forward (proposing, accepting,
    recording), max_step_ms: the slowest step, captures: graphs captured during the timed run}.
    `prompt_tokens`: random prompts of that length instead of `--prompt-tokens`."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    a = run.args
    n_prompt = prompt_tokens or a.prompt_tokens
    kv_dtype, k_scale, v_scale = kv or ("auto", None, None)
    cfg = EngineConfig(max_batch_size=batch, max_length=n_prompt + a.new_tokens + 16,
                       kv_cache_dtype=kv_dtype, spec_max_draft_tokens=k)
    eng = Engine(net, cfg, eos_token_ids=[], k_scale=k_scale, v_scale=v_scale, proposer=proposer,
                 runtime=runtime)
    gen = torch.Generator().manual_seed(batch)
    vocab = net.args.vocab_size
    if prompts is None:
        prompts = [torch.randint(vocab, (n_prompt,), generator=gen).tolist() for _ in range(batch)]
    graphs = runtime.stack if hasattr(runtime.stack, "captures") else None
    for _ in range(2):  # warm-up, then the timed run
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=a.new_tokens)) for p in prompts]
        while any(s.num_cached == 0 for s in seqs):
            eng.step()
        run.sync()
        steps = []
        captured = graphs.captures if graphs is not None else 0
        t = time.perf_counter()
        eng.run(on_step=lambda _: steps.append(eng.last_step))
        run.sync()
        dt = time.perf_counter() - t
    made = sum(len(s.output_ids) for s in seqs) - batch
    decode = [st for st in steps if st.decode] or steps
    return dict(tok_s=round(made / dt, 1), drafted=sum(s.stats.drafted for s in seqs),
                accepted=sum(s.stats.accepted for s in seqs),
                step_ms=round(statistics.median(st.seconds for st in decode) * 1e3, 3),
                host_ms=round(statistics.median(st.seconds - st.forward_seconds for st in decode) * 1e3, 3),
                max_step_ms=round(max(st.seconds for st in decode) * 1e3, 3),
                captures=(graphs.captures - captured) if graphs is not None else 0)


def step_profile(run: Run, net, runtime, batch: int = 1, steps: int = 8, top: int = 14) -> dict:
    """Where a decode step's time goes: `steps` decode steps of `batch` sequences (after their
    prefill and warm-up steps, so that the steps replay captured graphs) under torch's profiler
    → {step_ms: the profiled steps' mean wall time, busy_ms: per step, the device's time in
    kernels (CPU: in the ops' own code), kernels: [[name, launches per step, µs per step], ...]
    biggest first, `top` of them}. Busy time well below the step's is time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    a = run.args
    cfg = EngineConfig(max_batch_size=batch, max_length=a.prompt_tokens + 3 * steps + 16)
    eng = Engine(net, cfg, eos_token_ids=[], runtime=runtime)
    gen = torch.Generator().manual_seed(11)
    for _ in range(batch):
        eng.add_request(torch.randint(net.args.vocab_size, (a.prompt_tokens,), generator=gen).tolist(),
                        SamplingParams(max_new_tokens=3 * steps))
    for _ in range(steps):  # the prefill, then decode steps that capture the step's graphs
        eng.step()
    run.sync()
    cuda = run.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        run.sync()
        dt = time.perf_counter() - t
    kernels = []
    for ev in prof.key_averages():
        if cuda:
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
            if str(ev.device_type).endswith("CUDA") and us > 0:
                kernels.append((ev.key, ev.count, us))
        elif ev.self_cpu_time_total > 0:
            kernels.append((ev.key, ev.count, ev.self_cpu_time_total))
    kernels.sort(key=lambda k: -k[2])
    busy = sum(k[2] for k in kernels) / steps
    return dict(step_ms=round(dt / steps * 1e3, 3), busy_ms=round(busy / 1e3, 3),
                kernels=[[name[:70], round(n / steps, 2), round(us / steps, 1)] for name, n, us in kernels[:top]])


def repeating_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    """Prompts made of one random 48-token segment repeated: n-gram drafts find matches."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        seg = torch.randint(vocab, (48,), generator=gen).tolist()
        out.append((seg * (length // 48 + 1))[:length])
    return out


def verify_cost(run: Run, net, runtime, drafts=(0, 1, 2, 4, 8), repeats: int = 6) -> dict:
    """C(k): median step time verifying k drafts (copies of one token) / a plain step's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from spec_cost import FixedDrafter

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams

    drafter = FixedDrafter(token=0)
    eng = Engine(net, EngineConfig(max_batch_size=1, max_length=run.args.prompt_tokens + 256,
                                   spec_max_draft_tokens=max(drafts)),
                 eos_token_ids=[], proposer=drafter, runtime=runtime)
    prompt = torch.randint(net.args.vocab_size, (run.args.prompt_tokens,), generator=torch.Generator().manual_seed(3))
    eng.add_request(prompt.tolist(), SamplingParams(max_new_tokens=200))
    eng.step()
    times = {k: [] for k in drafts}
    for rep in range(repeats + 1):
        for k in drafts:
            drafter.k = k
            run.sync()
            t = time.perf_counter()
            eng.step()
            run.sync()
            if rep:  # the first pass warms each k's kernels up
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times[0])
    return {str(k): round(statistics.median(v) / base, 3) for k, v in times.items()} | {"step_ms": round(base * 1e3, 3)}


def runtime_with(run: Run, name: str, net, **policy):
    """The runtime of model `name`'s `net` under its `DispatchPolicy` (`policy_of`) but for
    `policy`'s fields."""
    import dataclasses

    from quantspec.infer.backend import prepare

    return prepare(net, run.device, policy=dataclasses.replace(policy_of(name), **policy))


def measure_model(run: Run, name: str, net, runtime, kv_scales=None) -> None:
    """Every measurement of one model (module docstring), most valuable first."""
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, ReferenceProposer, SpecCost

    plan = [(f"b{b}", lambda b=b: decode_speed(run, net, runtime, b)) for b in run.args.batch]
    if name in ("bf16", run.args.spec_model):
        plan.append(("b1 step profile", lambda: step_profile(run, net, runtime)))
    compared = run.device.type == "cuda" and name in ("bf16", run.args.spec_model)
    if compared and runtime.stack is not None and torch.cuda.get_device_capability(run.device) >= (9, 0):
        pdl = runtime_with(run, name, net, cuda_pdl=True)
        plan += [(f"b{b} programmatic launches", lambda b=b: decode_speed(run, net, pdl, b)) for b in run.args.batch]
    if compared and name == run.args.spec_model:  # keys split across programs, at this length and a long one
        split = runtime_with(run, name, net, cuda_split_kv=True)
        long = run.args.long_context
        plan += [("b1 split-KV attention", lambda: decode_speed(run, net, split, 1)),
                 (f"b1 context {long}", lambda: decode_speed(run, net, runtime, 1, prompt_tokens=long)),
                 (f"b1 context {long}, split-KV attention",
                  lambda: decode_speed(run, net, split, 1, prompt_tokens=long))]
    if compared and getattr(runtime.stack, "fused", False):  # the same model with its small ops unfused
        unfused = runtime_with(run, name, net, cuda_fused_ops=False)
        plan.append(("b1 small ops unfused", lambda: decode_speed(run, net, unfused, 1)))
    if compared and getattr(runtime.stack, "use_graphs", False):  # small ops as the default's
        eager = runtime_with(run, name, net, cuda_graphs=False)
        plan.append(("b1 eager (no CUDA graphs)", lambda: decode_speed(run, net, eager, 1)))
    if name == run.args.spec_model:
        k = 5

        def plain(batch: int, proposer=None):
            reps = repeating_prompts(net.args.vocab_size, batch, run.args.prompt_tokens)
            return decode_speed(run, net, runtime, batch, proposer=proposer, k=k if proposer else 0, prompts=reps)

        def ngram(backoff: bool, batch: int = 1):
            policy = AdaptiveDraftLength(k, SpecCost.for_device(run.device)) if backoff else None
            return plain(batch, ReferenceProposer(3, k, policy=policy))
        plan.append(("b1 repeating prompt, plain", lambda: plain(1)))
        plan.append(("b1 repeating prompt, n-gram k=5 back-off", lambda: ngram(True)))
        plan.append(("b1 repeating prompt, n-gram k=5 always", lambda: ngram(False)))
        plan.append(("verification cost C(k)", lambda: verify_cost(run, net, runtime)))
        # four sequences drafting different numbers of tokens: the padded verification graphs
        plan.append(("b4 repeating prompts, plain", lambda: plain(4)))
        plan.append(("b4 repeating prompts, n-gram k=5 always", lambda: ngram(False, 4)))
        if kv_scales is not None:
            k_amax, v_amax = kv_scales
            for kind, qmax in (("int8", 127.0), ("fp8", 448.0)):
                kv = (kind, (k_amax * 1.1 / qmax).clamp_min(1e-6), (v_amax * 1.1 / qmax).clamp_min(1e-6))
                plan.append((f"b1 {kind} KV cache", lambda kv=kv: decode_speed(run, net, runtime, 1, kv=kv)))
    for what, fn in plan:
        if run.over_budget():
            run.record(model=name, what=what, skipped="time box")
            continue
        try:
            run.record(model=name, what=what, **fn())
        except Exception as e:  # noqa: BLE001 - one failing measurement must not end the run
            run.record(model=name, what=what, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def markdown(run: Run, args) -> str:
    dev = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "CPU"
    lines = [f"### End to end: random-weight {args.num_layers}-layer Llama-3-8B-shaped model on {dev}\n",
             f"Prompt {run.args.prompt_tokens} tokens, {run.args.new_tokens} new tokens, greedy; "
             "decode-phase tokens/s (after the prefill); × = over bf16 at the same batch.\n",
             "| model | measurement | tokens/s | × bf16 | drafted / accepted | note |", "|---|---|---|---|---|---|"]
    base = {r["what"]: r.get("tok_s") for r in run.rows if r["model"] == "bf16"}
    profiles = [r for r in run.rows if "kernels" in r]
    for r in run.rows:
        if "kernels" in r:
            continue
        if "tok_s" in r:
            ref = base.get(r["what"])
            x = f"{r['tok_s'] / ref:.2f}×" if ref else ""
            da = f"{r['drafted']} / {r['accepted']}" if r.get("drafted") else ""
            steps = (f"step {r['step_ms']} ms (host {r['host_ms']}), slowest {r['max_step_ms']}"
                     if "host_ms" in r else "")
            if r.get("captures"):  # graphs the warm-up did not capture: their time is in the row
                steps += f"; {r['captures']} graph captures"
            lines.append(f"| {r['model']} | {r['what']} | {r['tok_s']} | {x} | {da} | {steps} |")
        elif "step_ms" in r:
            ck = ", ".join(f"C({k})={v}" for k, v in r.items() if k.isdigit())
            lines.append(f"| {r['model']} | {r['what']} | plain step {r['step_ms']} ms | | | {ck} |")
        elif "seconds" in r:
            lines.append(f"| {r['model']} | {r['what']} | | | | {r['seconds']} s |")
        else:
            lines.append(f"| {r['model']} | {r['what']} | | | | {r.get('error') or r.get('skipped')} |")
    for r in profiles:
        busy = f"{r['busy_ms']} ms ({r['busy_ms'] / r['step_ms']:.0%})" if r["step_ms"] else f"{r['busy_ms']} ms"
        lines += ["", f"#### {r['model']}, {r['what']}: step {r['step_ms']} ms, device busy {busy}\n",
                  "| kernel | launches per step | µs per step |", "|---|---|---|"]
        lines += [f"| `{name}` | {n} | {us} |" for name, n, us in r["kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default="out/gpu_e2e")
    ap.add_argument("--quant", default="bf16,int4,int4std,int8,fp8,a8w8",
                    help="models to build: bf16 and quantized ones (int4std: int4 in the standard layout)")
    ap.add_argument("--batch", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--spec-model", default="int4", help="the model speculation and KV caches are measured on")
    ap.add_argument("--long-context", type=int, default=4096,
                    help="the prompt length of the speculation model's long-context rows")
    ap.add_argument("--budget-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_e2e.py: no CUDA GPU here; pass --device cpu for the smoke run", file=sys.stderr)
        return 2
    run = Run(a)
    args = model_args(run)
    net = make_net(run, args)
    amax, k_amax, v_amax = calibrate(run, net, args)
    from quantspec.infer.backend import prepare

    for quant in a.quant.split(","):
        if run.over_budget():
            run.record(model=quant, what="all", skipped="time box")
            continue
        try:
            if quant == "bf16":
                qnet = net if net is not None else make_net(run, args)
                net = None
            else:
                del net
                net = None
                _free()
                qnet, seconds = quantized(run, args, quant, amax)
                run.record(model=quant, what="quantize (RTN, on the device)", seconds=round(seconds, 2))
            runtime = prepare(qnet, run.device, policy=policy_of(quant))
            measure_model(run, quant, qnet, runtime, kv_scales=(k_amax, v_amax))
        except Exception as e:  # noqa: BLE001 - the next model still runs
            run.record(model=quant, what="build", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        qnet = None
        _free()
    md = markdown(run, args)
    (run.out / "e2e.md").write_text(md)
    print(md)
    return 1 if any("error" in r for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
