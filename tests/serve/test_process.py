"""`quantspec serve` as a process: SIGTERM stops accepting, drains the stream in flight, exits;
bad flags are one line and exit 2; and on the default model with n-gram speculation, concurrent
greedy answers equal `quantspec infer`'s."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quantspec.cli", "serve", "--port", str(port), *args],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx2.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx2.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def test_sigterm_drains_the_request_in_flight_then_exits(tiny_llama_dir):
    proc, url = _start("--model", str(tiny_llama_dir), "--max-length", "2048", "--drain-timeout", "60")
    try:
        lines, first = [], threading.Event()

        def read():
            body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True}
            with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx2.HTTPError):  # no longer accepting
            httpx2.get(f"{url}/health", timeout=2)
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("args,flag", [(["--max-queue", "0"], "--max-queue"), (["--port", "x"], "--port"),
                                       (["--speculate-method", "mtp"], "--draft-model"),
                                       (["--max-stored-responses", "-1"], "--max-stored-responses")])
def test_bad_flags_are_one_line_and_exit_2(args, flag):
    r = subprocess.run([sys.executable, "-m", "quantspec.cli", "serve", *args], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and flag in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_default_model_concurrent_greedy_with_speculation_equals_quantspec_infer():
    """Code-edit prompts, 4 at once through a speculating server: each answer is what `quantspec
    infer` (batch 1, no speculation) gives for it."""
    import asyncio

    import openai

    from quantspec.infer.predictor import InferConfig, Predictor

    rows = [json.loads(line) for line in (ROOT / "bench/data/spec_prompts.jsonl").read_text().splitlines()]
    prompts = [r["src"] for r in rows][:4]
    want = [o.text for o in Predictor(InferConfig(max_new_tokens=32, max_length=1024)).generate(prompts)]
    proc, url = _start("--speculate-method", "inference_with_reference", "--max-length", "1024",
                       "--max-batch-size", "4", "--prefill-chunk", "64")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        calls = [client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                                max_tokens=32, temperature=0) for p in prompts]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    try:
        got = asyncio.run(main())
        metrics = httpx2.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert got == want
    accepted = [line for line in metrics.splitlines() if line.startswith("quantspec_spec_accepted_tokens_total")]
    assert float(accepted[0].rsplit(" ", 1)[1]) > 0
