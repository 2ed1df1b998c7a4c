"""What deploying `quantspec serve` takes beyond one machine's loopback: CORS for browser origins
(`--allowed-origins`, none by default), HTTPS (`--ssl-keyfile` / `--ssl-certfile`), the path
prefix of a reverse proxy that strips it (`--root-path`), request logs (`--enable-log-requests`), and one-line errors
for their bad values."""

from __future__ import annotations

import shutil
import subprocess

import httpx2
import pytest
from click.testing import CliRunner

from quantspec.errors import QuantSpecError
from quantspec.serve.server import ServeConfig

APP, OTHER = "https://app.example", "https://other.example"


def _preflight(url: str, origin: str) -> httpx2.Response:
    return httpx2.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


def test_cors_answers_the_allowed_origins_only(start_server, server):
    with start_server(allowed_origins=f'["{APP}"]') as (url, _):
        ok = _preflight(url, APP)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
        assert "access-control-allow-origin" not in _preflight(url, OTHER).headers
        r = httpx2.get(f"{url}/v1/models", headers={"Origin": APP})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    url, _ = server  # started without --allowed-origins: no CORS at all
    assert "access-control-allow-origin" not in _preflight(url, APP).headers
    assert "access-control-allow-origin" not in httpx2.get(f"{url}/v1/models", headers={"Origin": APP}).headers


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_key_and_certificate(start_server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    with start_server(ssl_keyfile=str(key), ssl_certfile=str(cert)) as (url, _):
        secure = url.replace("http://", "https://")
        r = httpx2.post(f"{secure}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, verify=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx2.HTTPError):  # plain HTTP on the TLS port
            httpx2.get(f"{url}/health", timeout=10)


@pytest.mark.parametrize("kw, needle", [
    ({"ssl_keyfile": "key.pem"}, "--ssl-certfile"),
    ({"ssl_keyfile": "/nonexistent/key.pem", "ssl_certfile": "/nonexistent/cert.pem"}, "no such file"),
    ({"allowed_origins": '["https://a.example"'}, "--allowed-origins"),
    ({"root_path": "llm"}, "--root-path"),
    ({"seed": "-1"}, "--seed"),
])
def test_bad_deployment_flags_are_one_line(kw, needle):
    with pytest.raises(QuantSpecError, match=needle.replace("-", "\\-")):
        ServeConfig(**kw)
    from quantspec.cli import main

    args = [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", v)]
    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_origins_read_as_vllm_s_json_list_or_comma_separated():
    assert ServeConfig(allowed_origins='["*"]').allowed_origins == ("*",)
    assert ServeConfig(allowed_origins=f"{APP}, {OTHER}").allowed_origins == (APP, OTHER)
    assert ServeConfig().allowed_origins == ()


def test_request_logs_name_each_request_and_never_its_text(start_server):
    import openai

    lines = []
    with start_server(enable_log_requests=True, on_stats=lines.append) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "secret words"}],
                                           max_tokens=5, temperature=0, extra_headers={"X-Request-Id": "abc"})
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, n=2, temperature=0.5, seed=1)
    mine = [line for line in lines if "chatcmpl-abc" in line]
    assert len(mine) == 2 and "accepted" in mine[0] and "greedy" in mine[0]
    assert f"{r.usage.completion_tokens} output tokens" in mine[1] and "first token" in mine[1]
    assert sum(" accepted: " in line and "cmpl-" in line and "-1 " in line for line in lines) == 1  # n=2: its own ids
    assert not any("secret" in line for line in lines)


def test_root_path_serves_behind_a_proxy_that_strips_its_prefix(start_server):
    """As vLLM's (uvicorn's root_path): the proxy serves /llm/v1/... and forwards /v1/..."""
    with start_server(root_path="/llm") as (url, _):
        assert httpx2.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_vllm_s_launch_flags(tiny_llama_dir, monkeypatch):
    """What a vLLM command line brings: --enforce-eager turns CUDA graphs off in the dispatch policy
    the model loads with; one device only; --quantization is the artifact's own format."""
    from quantspec.infer import loader
    from quantspec.infer.predictor import InferConfig, Predictor

    seen = []
    real = loader.load_for_inference

    def spy(*a, **kw):
        seen.append(kw.get("policy"))
        return real(*a, **kw)

    monkeypatch.setattr(loader, "load_for_inference", spy)
    Predictor(InferConfig(model=str(tiny_llama_dir), max_new_tokens=2, enforce_eager=True))
    Predictor(InferConfig(model=str(tiny_llama_dir), max_new_tokens=2))
    assert seen[0].cuda_graphs is False and seen[1] is None
    assert ServeConfig(model=str(tiny_llama_dir), enforce_eager=True).infer_config().enforce_eager
    assert ServeConfig(tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True).quantization is None
    for kw, flag in (({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"), ({"quantization": "awq"}, "--quantization")):
        with pytest.raises(QuantSpecError, match=flag):
            ServeConfig(**kw)


def test_seed_makes_the_unseeded_stream_reproducible(start_server):
    """--seed N: a server started again with the same seed samples the same answer to the same
    first request that sends no seed; another seed, another answer."""
    def first_answer(seed):
        with start_server(seed=seed, speculate_method="none") as (url, state):
            r = httpx2.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                          "temperature": 1.0}, timeout=60)
            return r.json()["choices"][0]["text"]

    assert first_answer(7) == first_answer(7) != first_answer(8)


def test_the_model_as_vllm_serve_s_positional_argument(tiny_llama_dir, monkeypatch):
    """`quantspec serve MODEL` (as `vllm serve MODEL`) is --model; both at once is one line, exit 2."""
    from quantspec import api
    from quantspec.cli import main

    served = []
    monkeypatch.setattr(api, "serve", lambda config, **kw: served.append(config))
    r = CliRunner().invoke(main, ["serve", str(tiny_llama_dir), "--port", "0"])
    assert r.exit_code == 0, r.output
    assert served[0].model == str(tiny_llama_dir) and served[0].served_model_name == str(tiny_llama_dir)
    r = CliRunner().invoke(main, ["serve", str(tiny_llama_dir), "--model", "smollm2-135m"])
    assert r.exit_code == 2 and "given twice" in r.stderr and len(r.stderr.strip().splitlines()) == 1
