"""`api.report` end to end on the tiny Llama: real artifacts, real generation with speculation.

Greedy speculative decoding is lossless by construction, so on the unquantized base the report
must find every prompt's tokens equal to the base's own; the numbers (acceptance, speedup) are
checked for range and internal consistency only (timings are not asserted).
"""

import json

import pytest

from quantspec import api


def test_report_on_tiny_model_real_generation(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    rep = api.report(out=str(out), model=str(tiny_llama_dir), speculate_method="draft",
                     base_quant_types="none,weight_only_int8", draft_quant_types="weight_only_int8,none",
                     cachekv="none", cache_dir=str(tmp_path / "cache"), max_new_tokens=12,
                     eval_seq_len=32, eval_windows=2)
    assert len(rep.cells) == 4
    by = {(c.base, c.draft): c for c in rep.cells}
    fp = by["none", "none"]
    assert fp.supported, fp.reason
    # the draft is the base itself: every draft token is the base's own greedy choice
    assert fp.lossless is True and fp.mismatched_prompts == 0
    assert fp.acceptance_rate == pytest.approx(1.0)
    assert fp.mean_accepted_length > 1.0
    for c in rep.cells:
        assert c.supported, f"{c.base}/{c.draft}: {c.reason}"
        assert 0.0 <= c.acceptance_rate <= 1.0
        assert c.speedup == pytest.approx(c.tokens_per_s / c.base_tokens_per_s)
        assert c.generated_tokens > 0 and c.peak_memory_mb > 0
    data = json.loads((out / "report.json").read_text())
    assert [c["key"] for c in data["cells"]] == [c.key for c in rep.cells]
    assert (out / "report.png").stat().st_size > 0


def test_report_ngram_on_tiny_model(tiny_llama_dir, tmp_path):
    rep = api.report(out=str(tmp_path / "out"), model=str(tiny_llama_dir), speculate_method="inference_with_reference",
                     base_quant_types="none", cachekv="none", cache_dir=str(tmp_path / "cache"),
                     max_new_tokens=12, eval_seq_len=32, eval_windows=2)
    (cell,) = rep.cells
    assert cell.supported, cell.reason
    assert cell.lossless is True
    assert cell.draft_artifact_mb is None and cell.base_perplexity > 1.0


def test_report_mtp_on_tiny_model(tiny_llama_dir, tmp_path):
    """`--speculate-method mtp`: the MTP module is the draft column, quantized per column."""
    import torch

    from quantspec.model_zoo.checkpoint import load_model
    from quantspec.model_zoo.mtp import save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    base, _ = load_model(tiny_llama_dir)
    mtp_dir = tmp_path / "mtp"
    save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), mtp_dir)
    rep = api.report(out=str(tmp_path / "out"), model=str(tiny_llama_dir), speculate_method="mtp",
                     draft_model=str(mtp_dir), base_quant_types="none,weight_only_int8",
                     draft_quant_types="none,weight_only_int8", cachekv="none", cache_dir=str(tmp_path / "cache"),
                     max_new_tokens=12, eval_seq_len=32, eval_windows=2)
    assert len(rep.cells) == 4
    for c in rep.cells:
        assert c.supported, f"{c.base}/{c.draft}: {c.reason}"
        assert c.lossless is True and 0.0 <= c.acceptance_rate <= 1.0
    quantized_draft = next(c for c in rep.cells if c.draft == "weight_only_int8")
    assert quantized_draft.draft_artifact_mb is not None and quantized_draft.draft_artifact_mb > 0


def _head(kind: str, tiny_llama_dir, out):
    """An untrained EAGLE-3 head or Medusa heads for the tiny Llama, as `zoo train-draft-head`
    saves them."""
    import torch

    from quantspec.model_zoo.checkpoint import load_model

    base, _ = load_model(tiny_llama_dir)
    if kind == "eagle":
        from quantspec.model_zoo.eagle3 import save_eagle3
        from quantspec.model_zoo.eagle3_train import init_eagle3

        return save_eagle3(init_eagle3(base, torch.arange(0, base.args.vocab_size, 2), (0, 1, 2)), out)
    from quantspec.model_zoo.medusa import save_medusa
    from quantspec.model_zoo.medusa_train import init_medusa

    return save_medusa(init_medusa(base, torch.arange(0, base.args.vocab_size, 2), num_heads=2), out)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_report_draft_heads_on_tiny_model(tiny_llama_dir, tmp_path, method):
    """`--speculate-method eagle / medusa`: the head is the draft column, quantized per column
    (base none / int4 × head none / int8), every cell lossless."""
    head = _head(method, tiny_llama_dir, tmp_path / "head")
    rep = api.report(out=str(tmp_path / "out"), model=str(tiny_llama_dir), speculate_method=method,
                     draft_model=str(head), base_quant_types="none,weight_only_int4",
                     draft_quant_types="none,weight_only_int8", cachekv="none", cache_dir=str(tmp_path / "cache"),
                     max_new_tokens=8, eval_seq_len=32, eval_windows=1)
    assert [(c.base, c.draft) for c in rep.cells] == [("none", "none"), ("none", "weight_only_int8"),
                                                      ("weight_only_int4", "none"),
                                                      ("weight_only_int4", "weight_only_int8")]
    for c in rep.cells:
        assert c.supported, f"{c.base}/{c.draft}: {c.reason}"
        assert c.method == method and c.lossless is True and 0.0 <= c.acceptance_rate <= 1.0
    int8 = rep.cell("none", "weight_only_int8", "none")
    assert 0 < int8.draft_artifact_mb < rep.cell("none", "none", "none").draft_artifact_mb
    assert f"speculate `{method}`" in (tmp_path / "out" / "report.md").read_text()
