"""bench/serve.py on the tiny model: it starts a server with and one without speculation, runs a
concurrency level and a Poisson rate through both, and prints / writes the table."""

import json

import pytest

pytestmark = pytest.mark.bench


def test_serve_bench_measures_both_servers_side_by_side(serve_bench, tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"kind": "chat", "src": s}) for s in ("a b a b", "hello there")))
    out = serve_bench.main(["--model", str(tiny_llama_dir), "--concurrency", "2", "--rates", "20", "--requests", "3",
                            "--max-tokens", "6", "--prompts", str(prompts), "--max-length", "256", "--threads", "1",
                            "--peer", "llama.cpp", "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert "| c=2 | quantspec none |" in printed and "| rate=20 | quantspec inference_with_reference |" in printed
    assert "llama.cpp peer is skipped" in printed or "| c=2 | llama.cpp |" in printed
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert len(runs) == 4 and all(r["requests"] == 3 and r["failed"] == 0 for r in runs)
    assert all(r["output_tok_per_s"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0 for r in runs)
    assert out["runs"] == runs


def test_serve_bench_measures_prefix_caching_with_a_shared_preamble(serve_bench, tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"kind": "chat", "src": s}) for s in ("a b a b", "hello there")))
    preamble = tmp_path / "system.txt"
    preamble.write_text("the quick brown fox jumps over the lazy dog " * 12)
    out = serve_bench.main(["--model", str(tiny_llama_dir), "--servers", "none,none+prefix", "--concurrency", "1",
                            "--requests", "4", "--max-tokens", "4", "--prompts", str(prompts), "--max-length", "512",
                            "--threads", "1", "--preamble", str(preamble)])
    share = {r["server"]: r["cached_share"] for r in out["runs"]}
    assert share["quantspec none"] == 0 and share["quantspec none+prefix"] > 0.5
    assert "| cached |" in out["table"]


def test_serve_bench_reports_preemptions_of_a_small_kv_cache_and_peak_memory(serve_bench, tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"kind": "chat", "src": f"tell me a story number {i}"}) for i in range(4)))
    # the tiny model's KV is 32 KiB per 64-token block: 224 KiB holds 6 blocks, one 256-token sequence and one more
    out = serve_bench.main(["--model", str(tiny_llama_dir), "--servers", "none,none+kv=224KiB", "--concurrency", "4",
                            "--requests", "8", "--max-tokens", "96", "--prompts", str(prompts), "--max-length", "256",
                            "--max-batch-size", "8", "--threads", "1"])
    runs = {r["server"]: r for r in out["runs"]}
    assert runs["quantspec none"]["preemptions"] == 0 and runs["quantspec none+kv=224KiB"]["preemptions"] > 0
    assert all(r["failed"] == 0 and r["peak_rss_mib"] > 0 for r in runs.values())
    assert "| preempted |" in out["table"]
