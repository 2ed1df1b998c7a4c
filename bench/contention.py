"""Decode speed beside a busy process: quantspec's engine quiet and with one busy loop pinned to
one of its CPUs, under quantspec's OpenMP wait policy (a short spin, `quantspec/threads.py`) and
under OpenMP's default (libgomp: a long spin), side by side in one run; prints medians and ratios.

    python bench/contention.py [--model smollm2-135m] [--rounds 5] [--new-tokens 128] [--threads N]

Each policy runs in a worker process of its own (OpenMP reads its wait policy once, when torch
loads it): "quantspec" imports quantspec before torch (quantspec's default), "spin" imports torch
first (OpenMP's own default, what torch does without quantspec). Both take the same thread count
(`--threads`, default: quantspec's, the CPUs this process may use). The busy process is a Python
loop pinned with `os.sched_setaffinity` to the last of those CPUs, stopped (SIGSTOP) for the quiet
runs and continued for the busy ones. Every round runs all four cells, quiet and busy alternating
which goes first, the two workers too; a cell is greedy decoding of `--new-tokens` tokens after a
`--prompt-tokens` prompt (decode-phase tokens/s, end of sequence ignored). Medians over rounds.
Other processes' CPU use is measured over each round (from /proc); a round in which they used more
than `--max-others` CPUs is measured again (at most `--rounds` times), and the header says what
they used.

The ratios to read: busy / quiet per policy (one busy process on 2 CPUs: the fair share is 0.5x)
and quantspec / spin quiet (what the policy costs on a quiet machine).
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

POLICIES = ("quantspec", "spin")
LABELS = {"quantspec": "quantspec's default", "spin": "OpenMP's default (torch imported first)"}
CONDITIONS = ("quiet", "busy")
# pinned to CPU argv[1]; killed with its parent (PR_SET_PDEATHSIG), even while stopped
_BUSY_LOOP = ("import ctypes, os, signal, sys\n"
              "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
              "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
              "while True:\n    pass\n")
_HZ = os.sysconf("SC_CLK_TCK")  # /proc's CPU-time ticks per second
_TEXT = "The history of the lighthouse is a story of engineering, weather and people. "


def worker(policy: str, model: str, threads: int | None, prompt_tokens: int) -> None:
    """Load `model` under `policy`, then answer each stdin line N with the decode-phase tokens/s
    of N greedy tokens (one line each)."""
    if policy == "spin":
        import torch  # noqa: F401  (first: OpenMP keeps its spin-waiting default)
    import quantspec  # noqa: F401  (in the "quantspec" worker before torch: its wait policy applies)
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


def _ticks(pids: list[int]) -> tuple[int, int]:
    """(the machine's busy CPU ticks, those of the processes `pids`), from /proc."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    ours = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on
        ours += int(fields[11]) + int(fields[12])  # utime, stime
    return sum(cpu) - cpu[3] - cpu[4], ours


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
    ap.add_argument("--max-others", type=float, default=0.1,
                    help="measure a round again (up to --rounds times) when other processes used more CPUs than this")
    ap.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for opt in ("rounds", "new_tokens", "prompt_tokens", "threads"):
        value = getattr(a, opt)
        if value is not None and value < 1:
            raise SystemExit(f"--{opt.replace('_', '-')} {value}: give 1 or more")
    if a.worker:
        worker(a.worker, a.model, a.threads, a.prompt_tokens)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through `finally`: no busy loop left behind
    cpus = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    workers: dict[str, _Worker] = {}
    busy = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(cpus[-1])])
    try:
        os.kill(busy.pid, signal.SIGSTOP)
        for policy in POLICIES:
            workers[policy] = _Worker(policy, a)
        runs = {(p, c): [] for p in POLICIES for c in CONDITIONS}
        others: list[float] = []  # CPUs other processes used during each kept round
        repeated = 0
        while len(others) < a.rounds:
            flip = (len(others) + repeated) % 2  # which condition and worker go first
            ours = [w.proc.pid for w in workers.values()] + [busy.pid, os.getpid()]
            t0, ticks0 = time.perf_counter(), _ticks(ours)
            cells = {}
            for cond in CONDITIONS[::-1 if flip else 1]:
                os.kill(busy.pid, signal.SIGCONT if cond == "busy" else signal.SIGSTOP)
                time.sleep(a.settle)
                for policy in POLICIES[::-1 if flip else 1]:
                    cells[policy, cond] = workers[policy].decode(a.new_tokens)
            ticks1 = _ticks(ours)
            other = ((ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])) / _HZ / (time.perf_counter() - t0)
            line = ", ".join(f"{p} {c} {v:.1f}" for (p, c), v in cells.items()) + f"; others used {other:.2f} CPUs"
            if other > a.max_others and repeated < a.rounds:
                repeated += 1
                print(f"round measured again ({line})", file=sys.stderr, flush=True)
                continue
            for key, value in cells.items():
                runs[key].append(value)
            others.append(other)
            print(f"round {len(others)}/{a.rounds}: {line}", file=sys.stderr, flush=True)
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
          f"other processes used {statistics.median(others):.2f} CPUs (median of the rounds; {repeated} round(s) "
          f"measured again), load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    rows = [[LABELS[p], workers[p].policy, f"{med[p, 'quiet']:.1f}", f"{med[p, 'busy']:.1f}",
             f"{med[p, 'busy'] / med[p, 'quiet']:.2f}x"] for p in POLICIES]
    print(markdown_table(["worker", "OpenMP wait", "quiet tok/s", "busy tok/s", "busy / quiet"], rows, "llrrr"))
    print(f"\nquantspec / spin: quiet {med['quantspec', 'quiet'] / med['spin', 'quiet']:.2f}x, "
          f"busy {med['quantspec', 'busy'] / med['spin', 'busy']:.2f}x")


if __name__ == "__main__":
    main()
