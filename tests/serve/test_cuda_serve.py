"""`quantspec infer` and `quantspec serve` on a GPU (`-m gpu`): an int4 artifact of a tiny model
whose head size the Triton attention takes, so that its decode and verification steps replay CUDA
graphs, in the server's engine thread too. Greedy answers in fp32 are the CPU's, with n-gram
speculation or without, whole and streamed (server-sent events), three requests at once. The
requests go through the standard library (a GPU image has the server's packages, `.gpu-vendor`,
not necessarily the `openai` client, which the CPU tests use)."""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from quantspec import api
from quantspec.infer.predictor import InferConfig, Predictor
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.serve.server import ServeConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "a b c d e f a b c d e f a b c",
           "hello there, how are you today"]
NEW = 24


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("m") / "m", hidden=128, heads=2, kv_heads=1, intermediate=256,
                         num_layers=2)
    return api.quantize(str(d), "weight_only_int4", tmp_path_factory.mktemp("a") / "a")


def _infer(artifact, device: str, spec: str):
    cfg = InferConfig(model=str(artifact), device=device, dtype="float32", max_new_tokens=NEW, max_length=256,
                      chat_template=False, speculate_method=spec)
    return Predictor(cfg).generate(PROMPTS)


@pytest.fixture(scope="module")
def cpu_answers(artifact):
    return _infer(artifact, "cpu", "none")


@pytest.mark.parametrize("spec", ["none", "inference_with_reference"])
def test_infer_on_the_gpu_gives_the_cpu_tokens(artifact, cpu_answers, spec):
    got = _infer(artifact, "cuda", spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in cpu_answers]


def _complete(url: str, prompt: str, stream: bool) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": stream})
    req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["text"]
        parts = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(parts)


def test_serve_on_the_gpu_gives_the_cpu_answers(artifact, cpu_answers, serve):
    config = ServeConfig(model=str(artifact), served_model_name="tiny", device="cuda", dtype="float32",
                         max_batch_size=4, max_length=256, speculate_method="inference_with_reference")
    with serve(config) as (url, state):
        stack = state.loop.engine.runtime.stack
        assert {(1, 1), (2, 1), (4, 1)} <= {k[:2] for k in stack.graphs}  # warmed up before serving
        want = [o.text for o in cpu_answers]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            for stream in (False, True):
                assert list(pool.map(lambda p: _complete(url, p, stream), PROMPTS)) == want, stream
        assert stack.replays > 0
