"""`quantspec infer` end to end on a tiny model, and its one-line errors for bad input."""

import json
import shutil

from click.testing import CliRunner

from quantspec.cli import main
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams
from quantspec.model_zoo.checkpoint import load_model


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def assert_one_line_error(result, pattern):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert pattern in err, err


def test_version_and_help_on_every_command():
    assert run("--version").output.startswith("quantspec")
    for name, cmd in main.commands.items():
        assert run(name, "--help").exit_code == 0, name


def test_prompt_greedy_matches_engine(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    r = run("infer", "--model", tiny_llama_dir, "--prompt", "the quick brown fox", "--no-chat-template",
            "--max-new-tokens", 12)
    assert r.exit_code == 0, r.output
    model, _ = load_model(tiny_llama_dir)
    eng = Engine(model, EngineConfig(max_length=2048), eos_token_ids=[2])
    seq = eng.add_request(tok("the quick brown fox").input_ids, SamplingParams(max_new_tokens=12))
    eng.run()
    assert r.stdout.strip() == tok.decode(seq.output_ids, skip_special_tokens=True).strip()


def test_data_file_rows_keep_fields_and_stats(tmp_path, tiny_llama_dir):
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"src": s, "id": i}) for i, s in enumerate(["a b c", "hello there", "x"])))
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    r = run("infer", "--model", tiny_llama_dir, "--data-file", data, "--output-file", out, "--batch-size", 2,
            "--max-new-tokens", 6, "--benchmark", "--stats-file", stats)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == [0, 1, 2]
    assert all(isinstance(row["output"], str) and len(row["output_token_ids"]) <= 6 for row in rows)
    s = json.loads(stats.read_text())
    for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "peak_memory_mb", "generated_tokens"):
        assert key in s
    assert s["generated_tokens"] == sum(len(row["output_token_ids"]) for row in rows)
    assert s["kv_cache"] == "float (float32)" and "kv_cache" in r.output


def test_infer_says_it_runs_the_artifacts_kv_cache(tmp_path, tiny_llama_dir):
    """An artifact with fp8 KV scales runs its static KV cache without a flag, and says so."""
    from quantspec import api

    calib = tmp_path / "t.calib"
    text = tmp_path / "c.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    api.calibrate(str(tiny_llama_dir), str(text), calib, num_samples=2, seq_len=32)
    art = api.quantize(str(tiny_llama_dir), "a8w8_fp8", tmp_path / "a", calib=str(calib), kv_cache="fp8",
                       smoothquant_alpha="none", fallback_budget=100.0)
    stats = tmp_path / "s.json"
    r = run("infer", "--model", art, "--prompt", "the quick", "--no-chat-template", "--max-new-tokens", 4,
            "--benchmark", "--stats-file", stats)
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["kv_cache"] == "fp8 static (the artifact's scales)"
    # vLLM's --kv-cache-dtype: float runs the model's dtype over the artifact's scales; int8 with
    # --calib is --cachekv-int8-type static
    r = run("infer", "--model", art, "--prompt", "the quick", "--no-chat-template", "--max-new-tokens", 4,
            "--kv-cache-dtype", "float", "--benchmark", "--stats-file", stats)
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["kv_cache"] == "float (float32)"
    outs = []
    for flags in (("--kv-cache-dtype", "int8"), ("--cachekv-int8-type", "static")):
        out = tmp_path / f"{flags[0]}.jsonl"
        r = run("infer", "--model", tiny_llama_dir, "--prompt", "the quick", "--no-chat-template",
                "--max-new-tokens", 6, *flags, "--calib", calib, "--output-file", out, "--benchmark",
                "--stats-file", stats)
        assert r.exit_code == 0, r.output
        assert json.loads(stats.read_text())["kv_cache"] == "int8 static (the calibration table's scales)"
        outs.append(json.loads(out.read_text())["output_token_ids"])
    assert outs[0] == outs[1]


def test_sampling_flags_are_seeded(tiny_llama_dir):
    args = ("infer", "--model", tiny_llama_dir, "--prompt", "once upon", "--decode-strategy", "sampling",
            "--temperature", 0.7, "--top-p", 0.9, "--seed", 1, "--max-new-tokens", 10, "--no-chat-template")
    a, b = run(*args), run(*args)
    assert a.exit_code == 0 and a.stdout == b.stdout


def test_bad_inputs_are_one_line(tmp_path, tiny_llama_dir):
    assert_one_line_error(run("infer", "--model", tmp_path / "missing", "--prompt", "x"), "does not exist")
    (tmp_path / "noconfig").mkdir()
    assert_one_line_error(run("infer", "--model", tmp_path / "noconfig", "--prompt", "x"), "no config.json")

    arch = tmp_path / "arch"
    shutil.copytree(tiny_llama_dir, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (arch / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run("infer", "--model", arch, "--prompt", "x"), "unsupported architecture")

    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_llama_dir, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert_one_line_error(run("infer", "--model", trunc, "--prompt", "x"), "truncated or corrupt")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_one_line_error(run("infer", "--model", tiny_llama_dir, "--data-file", empty), "is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"src": "ok"}\n{"src": "broken\n')
    assert_one_line_error(run("infer", "--model", tiny_llama_dir, "--data-file", bad), "bad.jsonl:2")


def test_prompt_longer_than_src_length(tiny_llama_dir):
    long = "word " * 200
    r = run("infer", "--model", tiny_llama_dir, "--prompt", long, "--src-length", 16, "--no-chat-template",
            "--max-new-tokens", 4)
    assert_one_line_error(r, "over --src-length 16; refused")
    r = run("infer", "--model", tiny_llama_dir, "--prompt", long, "--src-length", 16, "--no-chat-template",
            "--max-new-tokens", 4, "--truncate-prompt")
    assert r.exit_code == 0 and "truncated" in r.stderr


def test_infer_without_the_cpu_kernels_matches_transformers(tiny_llama_dir, hf_tiny_llama):
    """QUANTSPEC_CPU_KERNELS=0 (no compiler, or switched off): `infer` runs on torch's ops alone
    and its greedy text is transformers' greedy text."""
    import os
    import subprocess
    import sys

    import torch
    from transformers import AutoTokenizer

    env = dict(os.environ, QUANTSPEC_CPU_KERNELS="0")
    r = subprocess.run([sys.executable, "-c", "from quantspec.cli import main; main()", "infer", "--model", str(tiny_llama_dir),
                        "--prompt", "the quick brown fox", "--no-chat-template", "--max-new-tokens", "12",
                        "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = hf_tiny_llama
    ids = torch.tensor([tok("the quick brown fox").input_ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                      eos_token_id=2, pad_token_id=0)
    assert r.stdout.strip() == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_logprobs_go_into_the_output_rows(tmp_path, tiny_llama_dir, hf_logprobs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps({"src": "hello there"}) + "\n")
    r = run("infer", "--model", tiny_llama_dir, "--data-file", data, "--output-file", out, "--no-chat-template",
            "--max-new-tokens", 5, "--logprobs", 2)
    assert r.exit_code == 0, r.output
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    prompt = tok("hello there").input_ids
    ref = hf_logprobs(prompt + row["output_token_ids"])[len(prompt) - 1:]
    for j, (t, lp, top) in enumerate(zip(row["output_token_ids"], row["output_logprobs"], row["output_top_logprobs"])):
        assert abs(lp - float(ref[j, t])) < 1e-4
        assert [i for i, _ in top] == ref[j].topk(2).indices.tolist()
    assert len(row["output_logprobs"]) == len(row["output_token_ids"])
    assert_one_line_error(run("infer", "--model", tiny_llama_dir, "--prompt", "hi", "--logprobs", 2), "--output-file")
    assert_one_line_error(run("infer", "--model", tiny_llama_dir, "--data-file", data, "--output-file", out,
                              "--logprobs", 21), "--logprobs")


def test_structured_output_flags_hold_every_answer(tmp_path, tiny_llama_dir):
    import re

    import pytest

    pytest.importorskip("xgrammar")
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"src": s}) for s in ["a b c", "hello there", "x"]))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}},
                                  "required": ["n"], "additionalProperties": False}))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "ab" ("cd")*')

    def outputs(*flags):
        out = tmp_path / "out.jsonl"
        r = run("infer", "--model", tiny_llama_dir, "--data-file", data, "--output-file", out, "--batch-size", 2,
                "--max-new-tokens", 24, "--no-chat-template", "--decode-strategy", "sampling", "--seed", 1, *flags)
        assert r.exit_code == 0, r.output
        return [json.loads(line)["output"] for line in out.read_text().splitlines()]

    assert all(re.fullmatch(r"[0-9]{2}:[a-z]{2}", o) for o in outputs("--regex", r"[0-9]{2}:[a-z]{2}"))
    assert all(o in ("left", "right") for o in outputs("--choice", "left", "--choice", "right"))
    assert all(re.fullmatch(r"ab(cd)*", o) for o in outputs("--grammar", grammar))
    for o in outputs("--json-schema", schema):
        assert o.startswith('{"n": ')  # a prefix of the schema's JSON, whole where the answer ended
        if o.endswith("}"):
            assert isinstance(json.loads(o)["n"], int)


def test_prefix_caching_flag_reports_cached_tokens_and_keeps_the_answers(tmp_path, tiny_llama_dir):
    preamble = "the quick brown fox jumps over the lazy dog " * 6
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"src": preamble + q}) for q in ["a b c", "hello there", "x y"]))
    answers = []
    for flags in ((), ("--enable-prefix-caching",)):
        out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
        r = run("infer", "--model", tiny_llama_dir, "--data-file", data, "--output-file", out, "--block-size", 16,
                "--max-new-tokens", 6, "--no-chat-template", "--stats-file", stats, *flags)
        assert r.exit_code == 0, r.output
        answers.append([json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()])
        cached = json.loads(stats.read_text()).get("cached_prompt_tokens")
    assert answers[1] == answers[0]
    assert cached is not None and cached >= 2 * 16 and cached % 16 == 0


def test_serve_takes_vllm_s_names_of_its_length_batch_and_prefill_flags():
    from quantspec.cli import main

    serve = main.commands["serve"]
    ctx = serve.make_context("serve", ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "4096"])
    assert ctx.params["max_length"] == 512 and ctx.params["max_batch_size"] == 32
    assert ctx.params["max_prefill_tokens"] == 4096
    ctx = serve.make_context("serve", ["--max-length", "300", "--max-batch-size", "3"])
    assert ctx.params["max_length"] == 300 and ctx.params["max_batch_size"] == 3
