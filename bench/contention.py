"""Decode speed beside a busy process: quantspec's engine quiet and with one busy loop pinned to
one of its CPUs, for quantspec's OpenMP wait policy (passive) and libgomp's default (spin-wait),
side by side in one run; prints medians and ratios.

    python bench/contention.py [--model smollm2-135m] [--rounds 5] [--new-tokens 128] [--threads N]

Each policy runs in a worker process of its own (OpenMP reads its wait policy once, when torch
loads it): "passive" imports quantspec before torch (quantspec's default), "spin" imports torch
first (OpenMP's own default, what torch does without quantspec). Both take the same thread count
(`--threads`, default: quantspec's, the CPUs this process may use). The busy process is a Python
loop pinned with `os.sched_setaffinity` to the last of those CPUs, stopped (SIGSTOP) for the quiet
runs and continued for the busy ones. Every round runs all four cells, quiet and busy alternating
which goes first, the two workers too; a cell is greedy decoding of `--new-tokens` tokens after a
`--prompt-tokens` prompt (decode-phase tokens/s, end of sequence ignored). Medians over rounds.

The ratios to read: busy / quiet per policy (one busy process on 2 CPUs: the fair share is 0.5x)
and passive / spin quiet (what the policy costs on a quiet machine).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import subprocess
import sys
import time

POLICIES = ("passive", "spin")
LABELS = {"passive": "passive (quantspec's default)", "spin": "spin-wait (OpenMP's default, torch imported first)"}
CONDITIONS = ("quiet", "busy")
_BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
_TEXT = "The history of the lighthouse is a story of engineering, weather and people. "


def worker(policy: str, model: str, threads: int | None, prompt_tokens: int) -> None:
    """Load `model` under `policy`, then answer each stdin line N with the decode-phase tokens/s
    of N greedy tokens (one line each)."""
    if policy == "spin":
        import torch  # noqa: F401  (first: OpenMP keeps its spin-waiting default)
    import quantspec  # noqa: F401  (in the "passive" worker before torch: idle threads sleep)
    import torch

    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.sampler import SamplingParams
    from quantspec.threads import configure, wait_policy

    logging.getLogger("quantspec").setLevel(logging.ERROR)  # the "spin" worker's import-order warning
    count = configure(threads)
    loaded = load_for_inference(model)
    prompt = loaded.tokenizer(_TEXT * (prompt_tokens // 10 + 1)).input_ids[:prompt_tokens]

    def decode(n: int) -> float:
        eng = Engine(loaded.model, EngineConfig(max_batch_size=1, max_length=len(prompt) + n + 8),
                     eos_token_ids=[])
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=n))
        while seq.num_cached == 0:  # prefill (+ the first token)
            eng.step()
        t = time.perf_counter()
        eng.run()
        return (len(seq.output_ids) - 1) / (time.perf_counter() - t)

    decode(8)  # warm-up: kernels loaded, caches touched
    print(f"ready\t{count}\t{torch.get_num_threads()}\t{wait_policy()}", flush=True)
    for line in sys.stdin:
        print(f"{decode(int(line)):.4f}", flush=True)


class _Worker:
    def __init__(self, policy: str, a: argparse.Namespace):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [sys.executable, __file__, "--worker", policy, "--model", a.model,
               "--prompt-tokens", str(a.prompt_tokens)] + (["--threads", str(a.threads)] if a.threads else [])
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().rstrip("\n").split("\t")
        if ready[0] != "ready":
            raise SystemExit(f"the {policy} worker failed to start (see its error above)")
        self.threads, self.policy = int(ready[2]), ready[3]

    def decode(self, n: int) -> float:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name or model directory")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None, help="[default: quantspec's, the CPUs this process may use]")
    ap.add_argument("--settle", type=float, default=0.3, help="seconds between switching the busy loop and measuring")
    ap.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for opt in ("rounds", "new_tokens", "prompt_tokens", "threads"):
        value = getattr(a, opt)
        if value is not None and value < 1:
            raise SystemExit(f"--{opt.replace('_', '-')} {value}: give 1 or more")
    if a.worker:
        worker(a.worker, a.model, a.threads, a.prompt_tokens)
        return

    cpus = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    workers: dict[str, _Worker] = {}
    busy = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(cpus[-1])])
    try:
        os.kill(busy.pid, signal.SIGSTOP)
        for policy in POLICIES:
            workers[policy] = _Worker(policy, a)
        runs = {(p, c): [] for p in POLICIES for c in CONDITIONS}
        for r in range(a.rounds):
            for cond in CONDITIONS[::1 if r % 2 == 0 else -1]:
                os.kill(busy.pid, signal.SIGCONT if cond == "busy" else signal.SIGSTOP)
                time.sleep(a.settle)
                for policy in POLICIES[::1 if r % 2 == 0 else -1]:
                    runs[policy, cond].append(workers[policy].decode(a.new_tokens))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{p} {c} {v[-1]:.1f}" for (p, c), v in runs.items()),
                  file=sys.stderr, flush=True)
    finally:
        busy.kill()
        busy.wait()
        for w in workers.values():
            w.close()
    load_after = os.getloadavg()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mdtable import markdown_table

    med = {k: statistics.median(v) for k, v in runs.items()}
    threads = {w.threads for w in workers.values()}
    print(f"\n## decode tokens/s quiet and beside one busy process: {a.model}, {a.prompt_tokens}-token prompt, "
          f"{a.new_tokens} new tokens, {'/'.join(map(str, sorted(threads)))} thread(s) on CPUs "
          f"{','.join(map(str, cpus))}, busy loop on CPU {cpus[-1]}; medians of {a.rounds} interleaved rounds; "
          f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    rows = [[LABELS[p] if workers[p].policy.startswith(p) else f"{p}: the worker runs {workers[p].policy}",
             f"{med[p, 'quiet']:.1f}", f"{med[p, 'busy']:.1f}",
             f"{med[p, 'busy'] / med[p, 'quiet']:.2f}x"] for p in POLICIES]
    print(markdown_table(["OpenMP wait", "quiet tok/s", "busy tok/s", "busy / quiet"], rows, "lrrr"))
    print(f"\npassive / spin: quiet {med['passive', 'quiet'] / med['spin', 'quiet']:.2f}x, "
          f"busy {med['passive', 'busy'] / med['spin', 'busy']:.2f}x")


if __name__ == "__main__":
    main()
