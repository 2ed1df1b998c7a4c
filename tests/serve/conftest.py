"""A quantspec server on 127.0.0.1 (a free port) in a thread of the test process, over the tiny
model, for the real `openai` client; `reference` gives what `quantspec infer` (the Predictor)
answers for the same prompt; `metric` reads one value of its /metrics, `slow_steps` slows its engine
down so that requests queue."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest

from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.serve.server import ServeConfig, build, uvicorn_server

START_TIMEOUT_S = 30


@contextlib.contextmanager
def running_server(config: ServeConfig, *, loaded=None, tweak=None, kv_scales=None, on_stats=None):
    """Yield (base url, ServeState) of a server for `config` (its port: any free one); `tweak(state)`
    runs before it listens; `kv_scales`: `config.calib`'s (what `api.serve` reads); `on_stats(line)`:
    where its log lines go."""
    app, state = build(dataclasses.replace(config, port=0), loaded=loaded, kv_scales=kv_scales, on_stats=on_stats)
    if tweak is not None:
        tweak(state)
    server = uvicorn_server(app, dataclasses.replace(config, port=0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(30)
        state.loop.stop(timeout=10)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from quantspec.infer.loader import load_for_inference

    return load_for_inference(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tiny_loaded):
    """reference(prompt, max_tokens, chat=True, stop=(), ignore_eos=False) → (text, token ids) of
    `quantspec infer` (greedy, no speculation, batch 1)."""
    cache = {}

    def run(prompt: str, max_tokens: int, chat: bool = True, stop=(), ignore_eos: bool = False):
        key = (prompt, max_tokens, chat, tuple(stop), ignore_eos)
        if key not in cache:
            config = InferConfig(model=str(tiny_llama_dir), max_new_tokens=max_tokens, max_length=256,
                                 chat_template=chat, stop=tuple(stop), ignore_eos=ignore_eos)
            out = Predictor(config, loaded=tiny_loaded).generate([prompt])[0]
            cache[key] = (out.text, out.token_ids)
        return cache[key]

    return run


def tiny_config(tiny_llama_dir, **kw) -> ServeConfig:
    base = dict(model=str(tiny_llama_dir), served_model_name="tiny", max_batch_size=8, max_queue=64,
                max_length=256, prefill_chunk=16, speculate_method="inference_with_reference")
    return ServeConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_loaded):
    """(base url, state) of the module's server: the tiny model with n-gram speculation."""
    with running_server(tiny_config(tiny_llama_dir), loaded=tiny_loaded) as s:
        yield s


@pytest.fixture
def start_server(tiny_llama_dir, tiny_loaded):
    """start_server(**ServeConfig overrides, tweak=None, kv_scales=None, on_stats=None): a context
    manager over a tiny-model server."""

    def start(tweak=None, kv_scales=None, on_stats=None, **kw):
        return running_server(tiny_config(tiny_llama_dir, **kw), loaded=tiny_loaded, tweak=tweak, kv_scales=kv_scales,
                              on_stats=on_stats)

    return start


@pytest.fixture
def serve():
    """serve(config, loaded=None, tweak=None): `running_server` for a test's own model and config."""
    return running_server


@pytest.fixture
def metric():
    """metric(url, name) → the value of the sample `name` (with its labels, if any) on /metrics."""
    def read(url: str, name: str) -> float:
        import httpx2

        for line in httpx2.get(f"{url}/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    return read


@pytest.fixture
def slow_steps():
    """slow_steps(seconds) → a `tweak` for `start_server` after which every engine step takes
    `seconds` longer."""
    def make(seconds: float):
        def tweak(state):
            engine = state.loop.engine
            step = engine.step

            def slow_step():
                time.sleep(seconds)
                return step()

            engine.step = slow_step

        return tweak

    return make
