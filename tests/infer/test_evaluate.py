"""Perplexity through the paged inference path equals transformers' on the same windows."""

import math

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.evaluate import perplexity, windows
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.tiny import TINY_CORPUS

torch.set_num_threads(1)


def _hf_ppl(model_dir, win):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in win:
            logits = hf(input_ids=w[None]).logits[0, :-1].double()
            logp = torch.log_softmax(logits, -1)
            nll -= logp.gather(1, w[1:, None]).sum().item()
            n += w.numel() - 1
    return math.exp(nll / n)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_perplexity_matches_transformers(arch_dir, batch_size, request):
    model_dir = request.getfixturevalue(arch_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = torch.tensor(tok(TINY_CORPUS, add_special_tokens=False)["input_ids"])
    model, _ = load_model(model_dir)
    # seq_len 100 with block size 64: windows span a partial block
    res = perplexity(model, ids, seq_len=100, max_windows=5, batch_size=batch_size)
    ref = _hf_ppl(model_dir, windows(ids, 100, 5))
    assert res.num_windows == 5 and res.num_tokens == 5 * 99
    assert res.perplexity == pytest.approx(ref, rel=1e-4)


def test_int8_kv_cache_changes_ppl_slightly(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = torch.tensor(tok(TINY_CORPUS, add_special_tokens=False)["input_ids"])
    model, _ = load_model(tiny_llama_dir)
    base = perplexity(model, ids, seq_len=64, max_windows=4)
    L, KV = model.args.num_layers, model.args.num_kv_heads
    good = perplexity(model, ids, seq_len=64, max_windows=4, kv_cache_dtype="int8",
                      k_scale=torch.full((L, KV), 0.05), v_scale=torch.full((L, KV), 0.05))
    coarse = perplexity(model, ids, seq_len=64, max_windows=4, kv_cache_dtype="int8",
                        k_scale=torch.full((L, KV), 2.0), v_scale=torch.full((L, KV), 2.0))
    assert good.perplexity != base.perplexity
    assert abs(good.perplexity / base.perplexity - 1) < 0.05
    assert abs(coarse.perplexity / base.perplexity - 1) > abs(good.perplexity / base.perplexity - 1)
    assert good.kv_cache_dtype == "int8"


def test_bad_eval_inputs(tiny_llama_dir, tmp_path):

    model, _ = load_model(tiny_llama_dir)
    with pytest.raises(QuantSpecError, match="fewer than --seq-len"):
        perplexity(model, torch.arange(10), seq_len=64)
    with pytest.raises(QuantSpecError, match="int8 KV cache needs k/v scales|needs k/v scales"):
        perplexity(model, torch.arange(200), seq_len=64, kv_cache_dtype="int8")
    from quantspec import api

    with pytest.raises(QuantSpecError, match="exactly one"):
        api.evaluate(str(tiny_llama_dir))
    empty = tmp_path / "e.txt"
    empty.write_text("  \n")
    with pytest.raises(QuantSpecError, match="--text-file: .*empty"):
        api.evaluate(str(tiny_llama_dir), text_file=empty)


def test_perplexity_builds_no_autograd_graph(tiny_llama_dir):
    """Scoring a model whose parameters want grads records nothing for backward."""
    model, _ = load_model(tiny_llama_dir)
    for p in model.parameters():
        p.requires_grad_(True)
    seen = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    ids = torch.randint(3, 500, (130,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, ids, seq_len=64, max_windows=2)
    handle.remove()
    assert res.num_windows == 2 and seen and not any(seen)


def _hf_logits(model_dir, win) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(input_ids=w[None]).logits[0, :-1].double() for w in win]


def test_an_artifact_against_its_reference_matches_transformers(tiny_llama_dir, tmp_path):
    """`eval --reference`: KL(reference ‖ model) per token, top-1 agreement and both perplexities equal
    those of transformers' logits of the float model and of the artifact (compressed-tensors
    decompressing it) on the same windows; a model against itself scores 0 and 100%."""
    from transformers import AutoTokenizer

    from quantspec import api

    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "w4", group_size=32)
    text = tmp_path / "text.txt"
    text.write_text(TINY_CORPUS)
    res = api.evaluate(str(art), text_file=str(text), seq_len=100, max_windows=4, batch_size=3,
                       reference=str(tiny_llama_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    win = windows(torch.tensor(tok(TINY_CORPUS, add_special_tokens=False)["input_ids"]), 100, 4)
    kld, agree, nll, ref_nll = [], 0, 0.0, 0.0
    for lq, lp, w in zip(_hf_logits(art, win), _hf_logits(tiny_llama_dir, win), win):
        logq, logp = torch.log_softmax(lq, -1), torch.log_softmax(lp, -1)
        kld.append((logp.exp() * (logp - logq)).sum(-1))
        agree += int((lq.argmax(-1) == lp.argmax(-1)).sum())
        nll -= float(logq.gather(1, w[1:, None]).sum())
        ref_nll -= float(logp.gather(1, w[1:, None]).sum())
    kld = torch.cat(kld)
    n = kld.numel()
    assert res["num_tokens"] == n == 4 * 99 and res["reference"] == str(tiny_llama_dir)
    assert res["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-3, abs=1e-6)
    assert res["kld_max"] == pytest.approx(float(kld.max()), rel=1e-3, abs=1e-6)
    assert res["kld_p99"] == pytest.approx(float(torch.quantile(kld, 0.99)), rel=1e-3, abs=1e-6)
    assert res["top1_agreement"] == pytest.approx(agree / n, abs=2 / n)  # a near-tie may flip one token
    assert res["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert res["reference_perplexity"] == pytest.approx(math.exp(ref_nll / n), rel=1e-4)
    assert res["kld_mean"] > 1e-4 and res["top1_agreement"] < 1  # teeth: int4 moves the distributions
    same = api.evaluate(str(tiny_llama_dir), text_file=str(text), seq_len=100, max_windows=4,
                        reference=str(tiny_llama_dir))
    assert same["kld_max"] < 1e-6 and same["top1_agreement"] == 1 and same["delta_pct"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("other", [dict(vocab_pad_to=640), dict(tokenizer_variant=1)])
def test_a_reference_of_another_vocabulary_or_tokenizer_is_one_line(tiny_llama_dir, tmp_path, other):
    from quantspec import api
    from quantspec.model_zoo.tiny import build_tiny_model

    text = tmp_path / "text.txt"
    text.write_text(TINY_CORPUS)
    ref = build_tiny_model(tmp_path / "other", **other)
    with pytest.raises(QuantSpecError, match="--reference") as e:
        api.evaluate(str(tiny_llama_dir), text_file=str(text), seq_len=50, max_windows=1, reference=str(ref))
    assert "\n" not in str(e.value)
