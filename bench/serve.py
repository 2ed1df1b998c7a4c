"""Serving under load, in the manner of the serving benchmarks users know: fixed-concurrency sweeps
and Poisson arrivals against OpenAI-compatible servers, measured side by side in one run.

    python bench/serve.py [--model smollm2-135m] [--servers none,inference_with_reference]
                          [--url NAME=http://127.0.0.1:8000 ...] [--prompts bench/data/spec_prompts.jsonl]
                          [--kind code_edit|chat|all] [--preamble FILE] [--max-tokens 128] [--concurrency 1,4,16,64]
                          [--rates 0.5,1] [--requests N] [--rounds 1] [--threads 2] [--peer llama.cpp]
                          [--llama-python /work/llama-venv/bin/python] [--gguf M.gguf] [--json out.json]

Servers: each name in `--servers` is a `quantspec serve` this script starts on a free port of
127.0.0.1 (`none` = no speculation, else a `--speculate-method`; a `+prefix` suffix turns on
`--enable-prefix-caching`, `+kv=SIZE` sets `--kv-cache-memory SIZE`), plus any `--url NAME=URL`
already running. `--preamble FILE` sends
that text as every request's system message (a shared system prompt, what prefix caching is for). `--peer llama.cpp` adds llama.cpp's server (llama-cpp-python's `[server]`
extra, run by `--llama-python`, e.g. a venv of its own) on a free port, serving `--gguf` (default:
the GGUF the default model comes from, Q4_1: 4-bit, group 32, a float scale and min per group),
and says why it is skipped when that Python cannot import it. Against it, serve the same weights
in quantspec's format: `quantspec quantize --quant-type weight_only_int4 --group-size 32 --asym
--zp-dtype float16 --target quantspec --out smol.w4f/`, then `--model smol.w4f/`. Its server
streams no usage, so its output tokens are counted as the streamed chunks that carry text (it
streams a token per chunk).

Per run (one server × one load level): request throughput, output tokens/s, TTFT / TPOT / ITL
mean, p50 and p99 (ms), for quantspec servers the acceptance of the drafts verified in the
run and the sequences it preempted (from `/metrics`), the peak resident memory of a server this
script started (so far), and the share of prompt tokens a server reports cached (`usage`). Load levels run one after another and, within a level, every server in
turn (the order rotating by round), so load from other processes on a shared machine hits every
server alike. Every request streams (usage in the last chunk); greedy (temperature 0).
Prints a markdown table and the ratios of each server to the first; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mdtable import markdown_table  # noqa: E402

DEFAULT_PROMPTS = ROOT / "bench" / "data" / "spec_prompts.jsonl"
START_TIMEOUT_S = 300


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, as the server's usage reports them


@dataclass
class RunResult:
    server: str
    load: str  # "c=16" or "rate=1.0"
    requests: int
    failed: int
    wall_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    acceptance: float | None = None
    cached_share: float = 0.0  # prompt tokens reported cached / prompt tokens
    preemptions: int | None = None  # sequences the server preempted during the run
    peak_rss_mib: float | None = None  # the server process's peak resident memory so far


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(xs)
    return {"mean": 1000 * statistics.fmean(s), "p50": 1000 * s[len(s) // 2],
            "p99": 1000 * s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]}


# -- servers ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None, path: str = "/health") -> None:
    import httpx2

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx2.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {START_TIMEOUT_S} s")


def start_quantspec(method: str, args) -> tuple[subprocess.Popen, str]:
    """`quantspec serve` with speculation `method` ("none": without; "METHOD:K": at most K drafts
    per step; a "+prefix" suffix: with prefix caching; "+kv=SIZE": with --kv-cache-memory SIZE)
    on a free port."""
    method, *opts = method.split("+")
    method, _, k = method.partition(":")
    port = _free_port()
    cmd = [sys.executable, "-m", "quantspec.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-length", str(args.max_length),
           "--threads", str(args.threads), "--speculate-method", method]
    if k:
        cmd += ["--speculate-max-draft-token-num", k]
    for opt in opts:
        if opt == "prefix":
            cmd += ["--enable-prefix-caching"]
        elif opt.startswith("kv="):
            cmd += ["--kv-cache-memory", opt[3:]]
        else:
            raise SystemExit(f"--servers {method}+{opt}: the options are +prefix and +kv=SIZE")
    if args.draft_model and method in ("draft", "mtp"):
        cmd += ["--draft-model", args.draft_model]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    return proc, url


def llama_cpp_peer(args) -> str | None:
    """Why the llama.cpp peer is skipped (None: it can run, from `args.gguf`)."""
    if args.gguf is None:
        from quantspec.errors import QuantSpecError
        from quantspec.model_zoo.default import DEFAULT_MODEL, gguf_path

        try:
            args.gguf = str(gguf_path(DEFAULT_MODEL))
        except QuantSpecError as e:
            return f"{e}; the llama.cpp peer is skipped (or give --gguf)"
    r = subprocess.run([args.llama_python, "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"{args.llama_python} cannot import llama_cpp.server ({why}); the llama.cpp peer is skipped "
                "(pip install 'llama-cpp-python[server]' there, or give --llama-python)")
    if not Path(args.gguf).is_file():
        return f"--gguf {args.gguf} is not a file; the llama.cpp peer is skipped"
    return None


def start_llama_cpp(args) -> tuple[subprocess.Popen, str]:
    """llama.cpp's server (llama-cpp-python) over `--gguf` on a free port, `--threads` threads."""
    port = _free_port()
    cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", args.gguf, "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--n_ctx", str(args.max_length),
           # by default a request arriving interrupts the one streaming; every request must finish here
           "--interrupt_requests", "False", "--verbose", "False"]
    # its OpenMP threads sleep as soon as they idle: on a shared host libgomp's default spin (or
    # the short one quantspec's servers use) makes it several times slower, passive does not
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.setdefault("OMP_WAIT_POLICY", "passive")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, "/v1/models")
    return proc, url


# -- load generation ----------------------------------------------------------------------------

async def one_request(client, model: str, prompt: str, max_tokens: int, preamble: str | None = None
                      ) -> RequestResult:
    t0 = time.perf_counter()
    first = last = None
    itl, tokens, chunks, usage = [], 0, 0, None
    messages = ([{"role": "system", "content": preamble}] if preamble else []) + [{"role": "user", "content": prompt}]
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
            if chunk.usage is not None:
                tokens, usage = chunk.usage.completion_tokens, chunk.usage
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        print(f"  request failed: {type(e).__name__}: {e}", file=sys.stderr)
        return RequestResult(False)
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    return RequestResult(True, (first or end) - t0, end - t0, tokens or chunks, itl,
                         getattr(usage, "prompt_tokens", 0) or 0, getattr(details, "cached_tokens", 0) or 0)


async def closed_loop(client, model, prompts, n, concurrency, max_tokens, preamble=None) -> list[RequestResult]:
    """`n` requests, `concurrency` in flight at any time."""
    todo = list(range(n))
    results: list[RequestResult] = []

    async def worker():
        while todo:
            i = todo.pop(0)
            results.append(await one_request(client, model, prompts[i % len(prompts)], max_tokens, preamble))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def poisson(client, model, prompts, n, rate, max_tokens, preamble=None, seed=0) -> list[RequestResult]:
    """`n` requests arriving as a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one_request(client, model, prompts[i % len(prompts)], max_tokens,
                                                       preamble)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def _counters(url: str) -> dict[str, float]:
    """The speculation and preemption counters on a quantspec server's /metrics ({} for a peer)."""
    import httpx2

    try:
        text = httpx2.get(f"{url}/metrics", timeout=5).text
    except httpx2.HTTPError:
        return {}
    vals = {}
    for line in text.splitlines():
        for name in ("quantspec_spec_draft_tokens_total", "quantspec_spec_accepted_tokens_total",
                     "quantspec_num_preemptions_total"):
            if line.startswith(name + "{"):
                vals[name] = float(line.rsplit(" ", 1)[1])
    return vals


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident memory (VmHWM), MiB; None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_one(name: str, url: str, load: tuple[str, float], prompts: list[str], args,
            pid: int | None = None) -> RunResult:
    import openai

    kind, value = load
    before = _counters(url)

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600) as client:
            model = (await client.models.list()).data[0].id
            if kind == "c":
                n = args.requests or max(2 * int(value), len(prompts))
                return await closed_loop(client, model, prompts, n, int(value), args.max_tokens, args.preamble_text)
            n = args.requests or max(8, len(prompts))
            return await poisson(client, model, prompts, n, value, args.max_tokens, args.preamble_text)

    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    after = _counters(url)
    drafted, accepted, preempted = ("quantspec_spec_draft_tokens_total", "quantspec_spec_accepted_tokens_total",
                                    "quantspec_num_preemptions_total")
    acceptance = preemptions = None
    if drafted in before and drafted in after and after[drafted] > before[drafted]:
        acceptance = (after[accepted] - before[accepted]) / (after[drafted] - before[drafted])
    if preempted in before and preempted in after:
        preemptions = int(after[preempted] - before[preempted])
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return RunResult(name, f"{'c' if kind == 'c' else 'rate'}={value:g}", len(results), len(results) - len(ok), wall,
                     len(ok) / wall, sum(r.output_tokens for r in ok) / wall, _stats([r.ttft for r in ok]),
                     _stats(tpots), _stats([x for r in ok for x in r.itl]), acceptance,
                     sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), preemptions,
                     None if pid is None else peak_rss_mib(pid))


# -- the run ------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model of the servers this script starts")
    ap.add_argument("--servers", default="none,inference_with_reference",
                    help="quantspec servers to start: speculate methods ('none' = without, 'METHOD:K' = at most "
                         "K drafts per step; empty: none started)")
    ap.add_argument("--draft-model", default=None, help="for --servers draft / mtp")
    ap.add_argument("--url", action="append", default=[], help="NAME=URL of a server already running")
    ap.add_argument("--peer", default=None, choices=["llama.cpp"], help="add a peer server (if installed)")
    ap.add_argument("--llama-python", default=sys.executable, help="the Python with llama-cpp-python[server]")
    ap.add_argument("--gguf", default=None, help="the peer's GGUF [default: the default model's own]")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="jsonl with a `src` field (and `kind`)")
    ap.add_argument("--kind", default="all", help="keep only rows of this `kind` (code_edit, chat) or all")
    ap.add_argument("--preamble", default=None, help="a text file sent as every request's system message")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,16,64", help="fixed-concurrency levels ('' for none)")
    ap.add_argument("--rates", default="", help="Poisson arrival rates, requests/s ('' for none)")
    ap.add_argument("--requests", type=int, default=0, help="requests per run [default: max(2c, prompts)]")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every (server, load), interleaved")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server started")
    ap.add_argument("--json", default=None, help="write every run here")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.preamble_text = Path(args.preamble).read_text(encoding="utf-8") if args.preamble else None
    if not args.concurrency and not args.rates:
        ap.error("give --concurrency or --rates")
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in args.rates) or args.rounds < 1:
        ap.error("--concurrency and --rounds must be >= 1, --rates > 0")
    return args


def load_prompts(path: str, kind: str) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if kind == "all" or r.get("kind") == kind]
    if not rows:
        raise SystemExit(f"--prompts {path} has no rows of kind {kind!r}")
    return [r["src"] for r in rows]


def summarize(runs: list[RunResult]) -> tuple[str, list[dict]]:
    """A markdown table of every (load, server), its median run over rounds, and the ratio of each
    server's output tokens/s to the first server's at the same load."""
    keyed: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        keyed.setdefault((r.load, r.server), []).append(r)
    servers = list(dict.fromkeys(r.server for r in runs))
    rows, table = [], []
    for (load, server), rs in keyed.items():
        r = sorted(rs, key=lambda x: x.output_tok_per_s)[len(rs) // 2]
        base = sorted(keyed.get((load, servers[0]), rs), key=lambda x: x.output_tok_per_s)[len(rs) // 2]
        ratio = r.output_tok_per_s / base.output_tok_per_s if base.output_tok_per_s else 0.0
        acc = "" if r.acceptance is None else f"{100 * r.acceptance:.0f}%"
        table.append([load, server, r.requests - r.failed, f"{r.req_per_s:.2f}", f"{r.output_tok_per_s:.1f}",
                      f"{ratio:.2f}", f"{r.ttft_ms['mean']:.0f} / {r.ttft_ms['p50']:.0f} / {r.ttft_ms['p99']:.0f}",
                      f"{r.tpot_ms['mean']:.1f} / {r.tpot_ms['p50']:.1f} / {r.tpot_ms['p99']:.1f}",
                      f"{r.itl_ms['mean']:.1f} / {r.itl_ms['p50']:.1f} / {r.itl_ms['p99']:.1f}", acc,
                      f"{100 * r.cached_share:.0f}%", "" if r.preemptions is None else r.preemptions,
                      "" if r.peak_rss_mib is None else f"{r.peak_rss_mib:.0f}"])
        rows.append({**asdict(r), "vs_first": ratio})
    headers = ["load", "server", "ok", "req/s", "out tok/s", f"vs {servers[0]}", "TTFT ms mean/p50/p99",
               "TPOT ms mean/p50/p99", "ITL ms mean/p50/p99", "acceptance", "cached", "preempted", "peak RSS MiB"]
    return markdown_table(headers, table, "llrrrrrrrrrrr"), rows


def measure(servers: dict[str, str], prompts: list[str], args, pids: dict[str, int] | None = None
            ) -> list[RunResult]:
    loads = [("c", float(c)) for c in args.concurrency] + [("rate", r) for r in args.rates]
    names, runs = list(servers), []
    for load in loads:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for name in order:
                r = run_one(name, servers[name], load, prompts, args, (pids or {}).get(name))
                print(f"{r.load:>9} {name:>26}: {r.output_tok_per_s:7.1f} out tok/s, TTFT p50 {r.ttft_ms['p50']:.0f} ms"
                      f" p99 {r.ttft_ms['p99']:.0f} ms" + ("" if r.acceptance is None else
                                                            f", acceptance {100 * r.acceptance:.0f}%"), flush=True)
                runs.append(r)
    return runs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.kind)
    servers: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    pids: dict[str, int] = {}
    notes = []
    try:
        for method in [m for m in args.servers.split(",") if m.strip()]:
            proc, url = start_quantspec(method, args)
            procs.append(proc)
            servers[f"quantspec {method}"] = url
            pids[f"quantspec {method}"] = proc.pid
        for spec in args.url:
            name, _, url = spec.partition("=")
            _wait_healthy(url, None)
            servers[name] = url
        if args.peer == "llama.cpp":
            why = llama_cpp_peer(args)
            if why is None:
                proc, url = start_llama_cpp(args)
                procs.append(proc)
                servers["llama.cpp"] = url
                pids["llama.cpp"] = proc.pid
            else:
                notes.append(why)
                print(why)
        if not servers:
            raise SystemExit("no server to measure: give --servers or --url")
        runs = measure(servers, prompts, args, pids)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    table, rows = summarize(runs)
    print()
    print(table)
    out = {"args": {k: v for k, v in vars(args).items()}, "prompts": len(prompts), "notes": notes, "runs": rows,
           "table": table}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
