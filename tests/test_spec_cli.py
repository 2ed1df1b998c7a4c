"""`quantspec infer --speculate-method ...` end to end on tiny models: the same output token ids as
without speculation, acceptance figures in --stats-file, and one-line errors for bad knobs.
The smoke tests marked slow run the default model (SmolLM2-135M)."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantspec.cli import main
from quantspec.model_zoo.tiny import build_tiny_model

torch.set_num_threads(1)

ROWS = [
    "def area(w, h):\n    return w * h\n\ndef area(w, h):\n    return w * h",
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "Q: What is the capital of France? A:",
]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_cli") / "in.jsonl"
    path.write_text("".join(json.dumps({"src": s, "id": i}) + "\n" for i, s in enumerate(ROWS)))
    return path


def _infer(tmp_path, model, data_file, *extra, tag="plain", new_tokens=48):
    out, stats = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.stats.json"
    r = run("infer", "--model", model, "--data-file", data_file, "--output-file", out, "--stats-file", stats,
            "--max-new-tokens", new_tokens, "--max-length", 512, "--batch-size", 2, "--no-chat-template", *extra)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [row["output_token_ids"] for row in rows], json.loads(stats.read_text())


def test_ngram_cli_same_tokens_as_plain(tmp_path, tiny_llama_dir, data_file):
    plain, _ = _infer(tmp_path, tiny_llama_dir, data_file)
    spec, stats = _infer(tmp_path, tiny_llama_dir, data_file, "--speculate-method", "inference_with_reference",
                         "--speculate-max-draft-token-num", 4, "--speculate-max-ngram-size", 2, tag="ngram")
    assert spec == plain
    assert stats["speculate_method"] == "inference_with_reference"
    assert stats["drafted_tokens"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert 1 <= len(stats["acceptance_per_position"]) <= 4
    assert stats["mean_accepted_length"] >= 1.0


def test_draft_cli_same_tokens_as_plain(tmp_path, tiny_llama_dir, data_file):
    """The base drafting for itself through the CLI with its own head: identical tokens, every
    draft accepted."""
    plain, _ = _infer(tmp_path, tiny_llama_dir, data_file)
    # a second copy of the base, so the draft is loaded from its own directory
    spec, stats = _infer(tmp_path, tiny_llama_dir, data_file, "--speculate-method", "draft", "--draft-model",
                         tiny_llama_dir, "--speculate-max-draft-token-num", 3, "--speculate-draft-head", "artifact",
                         tag="draft")
    assert spec == plain
    if stats["drafted_tokens"]:  # the back-off may decline a self-draft as too costly on CPU
        assert stats["acceptance_rate"] == 1.0


def test_draft_cli_refuses_other_tokenizer(tmp_path, tiny_llama_dir):
    other = build_tiny_model(tmp_path / "other", "llama", tokenizer_variant=1)
    r = run("infer", "--model", tiny_llama_dir, "--prompt", "hello", "--speculate-method", "draft",
            "--draft-model", other)
    assert_one_line_error(r, "tokenizer", str(other), str(tiny_llama_dir))


@pytest.mark.parametrize("args,needle", [
    (["--speculate-method", "inference_with_reference", "--speculate-max-draft-token-num", 0],
     "--speculate-max-draft-token-num"),
    (["--speculate-method", "inference_with_reference", "--speculate-max-draft-token-num", 17],
     "--speculate-max-draft-token-num"),
    (["--speculate-method", "inference_with_reference", "--speculate-max-ngram-size", 0], "--speculate-max-ngram-size"),
    (["--speculate-method", "inference_with_reference", "--draft-model", "x"], "--draft-model"),
    (["--speculate-method", "draft"], "--draft-model"),
    (["--speculate-method", "inference_with_reference", "--speculate-draft-head", "int8"], "--speculate-draft-head"),
])
def test_bad_speculation_knobs_are_one_line_errors(tiny_llama_dir, args, needle):
    assert_one_line_error(run("infer", "--model", tiny_llama_dir, "--prompt", "hi", *args), needle)


# -- the default model ----------------------------------------------------------------------------

SMOKE_PROMPTS = [
    "Rename the variable `x` to `count` in this code and return the whole code:\n"
    "def f(items):\n    x = 0\n    for i in items:\n        if i > 0:\n            x += 1\n    return x\n",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def smoke_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_smoke") / "in.jsonl"
    path.write_text("".join(json.dumps({"src": s}) + "\n" for s in SMOKE_PROMPTS))
    return path


@pytest.mark.slow
def test_default_model_ngram_identical(tmp_path, smoke_file):
    plain, _ = _infer_chat(tmp_path, smoke_file, tag="plain")
    spec, stats = _infer_chat(tmp_path, smoke_file, "--speculate-method", "inference_with_reference", tag="ngram")
    assert spec == plain
    assert stats["accepted_tokens"] > 0


@pytest.mark.slow
def test_default_model_draft_identical(smoke_file):
    """The default model's int8 artifact drafting for the fp32 model (the fp32 model itself when
    quantization is unavailable), back-off off so every step drafts (on this CPU the back-off
    would switch an int8 draft off: it decodes no faster than fp32): greedy output identical."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.infer.loader import load_for_inference

    draft = "smollm2-135m"
    try:
        from quantspec import api
        from quantspec.model_zoo.default import cache_dir

        out = cache_dir() / "bench" / "smollm2-135m.weight_only_int8"
        if not (out / "config.json").exists():
            api.quantize("smollm2-135m", "weight_only_int8", out, overwrite=True)
        draft = str(out)
    except (ImportError, AttributeError):
        pass
    loaded = load_for_inference("smollm2-135m")
    common = dict(max_new_tokens=40, max_length=512, batch_size=2)
    plain = Predictor(InferConfig(**common), loaded=loaded).generate(SMOKE_PROMPTS)
    spec = Predictor(InferConfig(**common, speculate_method="draft", draft_model=draft,
                                 speculate_max_draft_token_num=4), loaded=loaded)
    spec.engine.proposer.policy = None
    outs = spec.generate(SMOKE_PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.accepted for o in outs) > 0


def _infer_chat(tmp_path, data_file, *extra, tag):
    out, stats = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.stats.json"
    r = run("infer", "--data-file", data_file, "--output-file", out, "--stats-file", stats, "--max-new-tokens", 40,
            "--max-length", 512, *extra)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [row["output_token_ids"] for row in rows], json.loads(stats.read_text())


def test_vllm_speculative_config_runs_the_same_ngram_speculation(tmp_path, tiny_llama_dir, data_file):
    plain, _ = _infer(tmp_path, tiny_llama_dir, data_file)
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
    spec, stats = _infer(tmp_path, tiny_llama_dir, data_file, "--speculative-config", config, tag="vllm")
    assert spec == plain and stats["speculate_method"] == "inference_with_reference"
    assert stats["drafted_tokens"] > 0 and 1 <= len(stats["acceptance_per_position"]) <= 3


@pytest.mark.parametrize("extra, needles", [
    (["--speculative-config", "{method: ngram}"], ["--speculative-config", "not JSON"]),
    (["--speculative-config", '["ngram"]'], ["JSON object"]),
    (["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 4}'], ["disable_by_batch_size"]),
    (["--speculative-config", '{"method": "lookahead"}'], ["lookahead", "ngram"]),
    (["--speculative-config", '{"method": "eagle3"}'], ["eagle3", "model"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], ["num_speculative_tokens"]),
    (["--speculative-config", '{"method": "ngram"}', "--speculate-method", "draft"], ["--speculate-method", "give one"]),
    (["--speculate-method", "inference_with_reference", "--speculate-min-ngram-size", 4,
      "--speculate-max-ngram-size", 3], ["--speculate-min-ngram-size"]),
])
def test_bad_speculative_config_is_one_line(tiny_llama_dir, extra, needles):
    r = run("infer", "--model", tiny_llama_dir, "--prompt", "hi", "--max-new-tokens", 2, *extra)
    assert_one_line_error(r, *needles)
    assert r.exit_code == 2


def test_speculative_config_maps_onto_quantspec_flags(tiny_llama_model):
    from types import SimpleNamespace

    from quantspec.api import InferConfig
    from quantspec.cli.speculative import read_speculative_config
    from quantspec.infer.spec.proposers import build_proposer

    assert read_speculative_config('{"method": "eagle3", "model": "h/", "num_speculative_tokens": 4}') == {
        "speculate_method": "eagle", "draft_model": "h/", "speculate_max_draft_token_num": 4}
    assert read_speculative_config('{"model": "d/"}') == {"speculate_method": "draft", "draft_model": "d/"}
    assert read_speculative_config('{"method": "deepseek_mtp", "model": "m/"}')["speculate_method"] == "mtp"
    sizes = [(c["speculate_min_ngram_size"], c["speculate_max_ngram_size"]) for c in map(read_speculative_config, (
        '{"method": "ngram"}', '{"method": "ngram", "prompt_lookup_max": 4}', '{"method": "ngram", "prompt_lookup_min": 2}'))]
    assert sizes == [(5, 5), (4, 4), (2, 2)]  # vLLM's defaults
    proposer, _ = build_proposer(InferConfig(speculate_method="inference_with_reference", speculate_min_ngram_size=2),
                                 SimpleNamespace(model=tiny_llama_model))
    assert (proposer.min_ngram_size, proposer.max_ngram_size) == (2, 3)
