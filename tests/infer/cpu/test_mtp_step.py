"""The MTP draft step in one C++ call (`infer/cpu/mtp_step.py`) and the int8 draft head: bitwise
the modules' result for fp32 and quantized MTP artifacts, the modules run wherever the plan would
not be their computation, and the int8 head computes with its codes × scales."""

import json
from types import SimpleNamespace

import pytest
import torch

from quantspec.infer.backend import prepare
from quantspec.infer.cpu.linears import PackedInt8Linear
from quantspec.infer.cpu.mtp_step import CpuMTPStep
from quantspec.infer.spec.mtp import build_mtp_proposer, load_mtp_for_inference, mtp_draft_cost
from quantspec.kernels.cpu import cpu_kernels
from quantspec.model_zoo.mtp import save_mtp
from quantspec.model_zoo.mtp_train import init_mtp

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")



@pytest.fixture(scope="module")
def base(tiny_llama_model):
    torch.set_num_threads(1)
    return tiny_llama_model


@pytest.fixture(scope="module")
def mtp_dirs(base, tmp_path_factory):
    """An fp32 MTP artifact (a third of the vocabulary drafts) and its int8 / int4 quantizations."""
    from quantspec.calib.ptq import quantize_model
    from quantspec.model_zoo.mtp import load_mtp
    from quantspec.quant.presets import preset
    from quantspec.quant.artifact import write_artifact

    root = tmp_path_factory.mktemp("mtp_fused")
    fp32 = save_mtp(init_mtp(base, torch.arange(0, base.args.vocab_size, 3), seed=4), root / "fp32")
    dirs = {"fp32": fp32}
    for qt in ("weight_only_int8", "weight_only_int4"):
        res = quantize_model(load_mtp(fp32), preset(qt, group_size=32), "rtn")
        cfg = json.loads((fp32 / "config.json").read_text())
        cfg["quantization_config"] = res.config.to_dict()
        dirs[qt] = write_artifact(root / qt, res.tensors, cfg)
    return dirs


def _prepared(path, base):
    """An MTP artifact loaded for `base` and prepared for the CPU → (module, its runtime)."""
    mtp = load_mtp_for_inference(path, base)
    return mtp, prepare(mtp, "cpu")


def _inputs(mtp, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = mtp.args.block.hidden_size
    h = torch.randn(rows, D, generator=g) * 4  # base hidden states are not unit-scale
    tok = torch.randint(0, mtp.args.block.vocab_size, (rows,), generator=g)
    return h, tok


@pytest.mark.parametrize("which", ["fp32", "weight_only_int8", "weight_only_int4"])
def test_fused_step_equals_the_modules_bitwise(base, mtp_dirs, which):
    mtp, runtime = _prepared(mtp_dirs[which], base)
    step, head = runtime.draft_step, runtime.draft_head
    assert isinstance(step, CpuMTPStep)
    with torch.inference_mode():
        for rows in (1, 3, 9):
            h, tok = _inputs(mtp, rows, seed=rows)
            got_h, got_logits = step(h, tok)
            want_h = mtp(h, tok)
            want_logits = mtp.draft_logits(want_h, head)
            assert torch.equal(got_h, want_h) and torch.equal(got_logits, want_logits)
            # chained: the second depth starts from the first depth's hidden state
            h2, l2 = step(got_h, got_logits.argmax(-1))
            assert torch.equal(h2, mtp(want_h, want_logits.argmax(-1)))
            assert torch.equal(l2, mtp.draft_logits(h2, head))


def test_a_broken_plan_would_be_caught(base, mtp_dirs, monkeypatch):
    """The comparison above can fail: a plan built over another module's weights (the eh_proj
    of a differently seeded MTP) gives other hidden states."""
    mtp, runtime = _prepared(mtp_dirs["fp32"], base)
    other = save_mtp(init_mtp(base, torch.arange(0, base.args.vocab_size, 3), seed=9), mtp_dirs["fp32"].parent / "other")
    wrong, _ = _prepared(other, base)
    mtp.model.eh_proj, keep = wrong.model.eh_proj, mtp.model.eh_proj
    step = CpuMTPStep.build(mtp, runtime.draft_head)
    mtp.model.eh_proj = keep  # the plan holds the other weights; the check below sees the swap ...
    h, tok = _inputs(mtp, 2)
    with torch.inference_mode():
        assert step(h, tok) is None  # ... and the modules run
        monkeypatch.setattr(step, "_watch", [[], [], []])  # without the check, the numbers differ
        got_h, _ = step(h, tok)
        assert not torch.equal(got_h, mtp(h, tok))


def test_the_modules_run_where_the_plan_would_not_be_their_computation(base, mtp_dirs, monkeypatch):
    mtp, runtime = _prepared(mtp_dirs["weight_only_int8"], base)
    step = runtime.draft_step
    h, tok = _inputs(mtp, 2)
    with torch.inference_mode():
        assert step(h, tok) is not None
        handle = mtp.model.layers[0].mlp.register_forward_hook(lambda *a: None)
        assert step(h, tok) is None  # a hook observes the modules
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        assert step(h, tok) is None  # a global hook too
        handle.remove()
        handle = runtime.draft_head.register_forward_pre_hook(lambda *a: None)
        assert step(h, tok) is None  # and one on the draft head
        handle.remove()
        assert step(h, tok) is not None
        assert step.max_rows is not None  # a QuantLinear leaves its row kernel beyond this
        big_h, big_tok = _inputs(mtp, step.max_rows + 1)
        assert step(big_h, big_tok) is None
        assert step(h.bfloat16(), tok) is None  # another dtype than the plan's
        mtp.model.norm.weight = torch.nn.Parameter(mtp.model.norm.weight.detach().clone())
        assert step(h, tok) is None  # a re-assigned tensor
    monkeypatch.setenv("QUANTSPEC_FUSED_LAYERS", "0")
    assert CpuMTPStep.build(mtp, runtime.draft_head) is None
    monkeypatch.delenv("QUANTSPEC_FUSED_LAYERS")
    from quantspec.model_zoo.mtp import load_mtp

    plain = load_mtp(mtp_dirs["fp32"], base)
    assert CpuMTPStep.build(plain, _prepared(mtp_dirs["fp32"], base)[1].draft_head) is None  # torch's modules: no plan


def test_proposer_drafts_through_the_plan_and_the_int8_head(base, mtp_dirs):
    """The factory's proposer takes the plan; its head is the int8 draft head, whose output is
    its codes × scales, within int8 rounding of the fp32 head."""
    config = SimpleNamespace(draft_model=str(mtp_dirs["fp32"]), speculate_max_draft_token_num=2)
    proposer, _ = build_mtp_proposer(config, SimpleNamespace(model=base))
    mtp = proposer.mtp
    assert proposer.step is not None
    head = proposer.head
    assert type(head) is PackedInt8Linear
    w = mtp._shared["head"]  # the fp32 rows it was rounded from
    deq = head.dense_weight()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((deq - w).abs() <= step / 2 + 1e-7).all() and not torch.equal(deq, w)
    x = torch.randn(5, w.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(head(x), x @ deq.t(), rtol=1e-5, atol=1e-5)
    # the back-off's cost model counts bytes: an int8 MTP drafts cheaper than the fp32 one
    q8, q8_runtime = _prepared(mtp_dirs["weight_only_int8"], base)
    assert mtp_draft_cost(q8, base, q8_runtime.draft_head) < mtp_draft_cost(mtp, base, head)
