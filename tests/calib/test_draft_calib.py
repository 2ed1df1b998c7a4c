"""GPTQ of draft modules (`calib.draft_calib`): the Hessians are of the inputs each module reads
while it drafts on its base's hidden states (transformers' hidden states of the base as the
reference), the artifact's codes are GPTQ's on them, GPTQ's modules draft closer to the float
ones than round-to-nearest's on held-out windows, a GPTQ head keeps speculation lossless, and the
base is the one the module records or `--base`."""

import json

import pytest
import torch
from click.testing import CliRunner

from quantspec import api
from quantspec.calib.draft_calib import draft_hessians, draft_passes
from quantspec.calib.ptq import quantize_model
from quantspec.cli import main
from quantspec.errors import QuantSpecError
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3 import load_eagle3, save_eagle3
from quantspec.model_zoo.eagle3_train import init_eagle3
from quantspec.model_zoo.medusa import load_medusa, save_medusa
from quantspec.model_zoo.medusa_train import init_medusa
from quantspec.model_zoo.mtp import load_mtp, save_mtp
from quantspec.model_zoo.mtp_train import init_mtp
from quantspec.model_zoo.tiny import TINY_CORPUS
from quantspec.quant.gptq import gptq_quantize
from quantspec.quant.presets import preset

torch.set_num_threads(1)
AUX = (0, 1, 2)  # the tiny Llama's 2 layers: its embeddings, layer 1's input, the last output
INT4 = dict(group_size=16, symmetric=True)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The tiny Llama with outlier channels in its norms, as trained LLMs have (GPTQ's Hessians
    matter there)."""
    from test_awq import _outlier_model

    return _outlier_model(tmp_path_factory.mktemp("outlier"))


@pytest.fixture(scope="module")
def base(base_dir):
    return load_model(base_dir)[0]


def _noisy(module, seed):
    """The recipe's initial module with noise on every weight: a module that has trained away from it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module


@pytest.fixture(scope="module")
def modules(base, base_dir, tmp_path_factory):
    return draft_modules(base, base_dir, tmp_path_factory.mktemp("drafts"))


def draft_modules(base, base_dir, root):
    """kind → (directory under `root`, loader) of an MTP module, Medusa heads and an EAGLE-3 head
    of the tiny Llama; the MTP module and the EAGLE-3 head record their base as `zoo train-mtp`
    and `train-draft-head` do."""
    vocab = torch.arange(0, 512, 2)
    save_mtp(_noisy(init_mtp(base, torch.arange(512), seed=0), 1), root / "mtp",
             {"quantspec_training": {"base": str(base_dir)}})
    save_medusa(_noisy(init_medusa(base, vocab, num_heads=2), 2), root / "medusa")
    save_eagle3(_noisy(init_eagle3(base, vocab, AUX), 3), root / "eagle3",
                extra_config={"training": {"base": str(base_dir)}})
    return {"mtp": (root / "mtp", lambda p: load_mtp(p, base)), "medusa": (root / "medusa", load_medusa),
            "eagle3": (root / "eagle3", load_eagle3)}


def _windows(n, S, seed):
    return torch.randint(3, 500, (n, S), generator=torch.Generator().manual_seed(seed))


def _hf_streams(model_dir, windows):
    """transformers' residual streams entering each decoder layer, the last layer's output and
    the final-normed states, per window: [(entering [L] × [S, D], last [S, D], normed [S, D])]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seen = {}

    def pre(i):
        def hook(_m, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"])[0]
        return hook

    layers = hf.model.layers
    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("last", (out[0] if isinstance(out, tuple) else out)[0])))
    handles.append(hf.model.norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("normed", out[0])))
    rows = []
    with torch.no_grad():
        for w in windows:
            hf(w[None])
            rows.append(([seen[i] for i in range(len(layers))], seen["last"], seen["normed"]))
    for h in handles:
        h.remove()
    return rows


def mtp_eh_inputs(mtp, base, windows, hf):
    """What an MTP module's eh_proj reads while it drafts 2 deep on `windows` (`hf`: `_hf_streams`):
    the normed next-token embedding beside the normed pre-norm state, then beside its own output."""
    embed, m, ins = base.model.embed_tokens, mtp.model, []
    with torch.no_grad():
        for w, (_, last, _) in zip(windows, hf):
            h = last[:-1]
            for depth in range(2):
                t = w[1 + depth:]
                ins.append(torch.cat([m.enorm(embed(t)), m.hnorm(h[:len(t)])], dim=-1))
                h = mtp(h[:len(t)], t)
    return ins


def _hessian(xs):
    x = torch.cat(xs).double()
    return (2 / x.shape[0] * x.T @ x).float()


def _config(**kw):
    return preset("weight_only_int4", **{**INT4, **kw})


def test_hessians_are_of_the_base_states_the_module_reads(modules, base, base_dir):
    """From transformers' forward of the base: EAGLE-3's fc reads the aux layers' streams side by
    side at every position but the last, and its lm_head the normed output of each of the 4
    unrolled drafts (the training-time test's, itself checked against inference); each Medusa
    head's first ResBlock reads the final-normed states; an MTP module's eh_proj reads the
    normed embedding of the next token beside the normed pre-norm state, then beside its own
    output. Linears sharing an input (q / k / v) get the same Hessian."""
    from quantspec.model_zoo.eagle3_train import ttt_outputs

    windows = _windows(3, 24, 0)
    hf = _hf_streams(base_dir, windows)
    feats = [torch.cat([*entering, last], dim=-1)[:-1] for entering, last, _ in hf]
    head, heads, mtp = (modules[k][1](modules[k][0]) for k in ("eagle3", "medusa", "mtp"))
    head.bind_embedding(base.model.embed_tokens)
    mtp.bind_base(base)
    with torch.no_grad():
        drafts = [head.norm(h) for w, f in zip(windows, feats) for h in ttt_outputs(head, w, f, 4)]
        ins = mtp_eh_inputs(mtp, base, windows, hf)
    want = {"fc": _hessian(feats), "lm_head": _hessian(drafts), "medusa_head.0.0.linear": _hessian([n for *_, n in hf]),
            "model.eh_proj": _hessian(ins)}
    got = {**draft_hessians(head, base, windows, _config(ignore=())),
           **draft_hessians(heads, base, windows, _config()), **draft_hessians(mtp, base, windows, _config())}
    for name, H in want.items():
        torch.testing.assert_close(got[name], H, rtol=1e-4, atol=1e-4 * float(H.abs().max()), msg=name)
    assert torch.equal(got["midlayer.self_attn.q_proj"], got["midlayer.self_attn.v_proj"])
    assert torch.equal(got["model.layers.0.mlp.gate_proj"], got["model.layers.0.mlp.up_proj"])
    assert torch.equal(got["medusa_head.1.0.linear"], got["medusa_head.0.0.linear"])


@pytest.mark.parametrize("kind", ["mtp", "medusa", "eagle3"])
def test_the_codes_are_gptq_on_the_measured_hessians(modules, base, kind):
    path, load = modules[kind]
    module, config = load(path), _config()
    H = draft_hessians(module, base, _windows(2, 16, 1), config)
    weights = {n: module.get_submodule(n).weight.detach().clone() for n in H}
    res = quantize_model(module, config, "gptq", hessians={n: h.clone() for n, h in H.items()})
    assert set(res.layer_args) == set(H)
    for name, h in H.items():
        want = gptq_quantize(weights[name], h, res.layer_args[name])
        assert torch.equal(module.get_submodule(name).weight, want.weight_dq), name
        assert torch.equal(res.tensors[f"{name}.weight_scale"], want.scale), name


def _draft_outputs(module, base, windows):
    """What the module computes while it drafts (every forward's output) on `windows`."""
    outs = []
    handle = module.register_forward_hook(lambda _m, _a, out: outs.append(out.detach().flatten()))
    with torch.no_grad():
        for _ in draft_passes(module, base, windows):
            pass
    handle.remove()
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["mtp", "medusa", "eagle3"])
def test_gptq_drafts_closer_to_the_float_module_than_rtn(modules, base, kind):
    """On held-out windows, the GPTQ module's drafting outputs are nearer the float module's than
    round-to-nearest's (the same grid), which is what its Hessians are for."""
    path, load = modules[kind]
    held_out = _windows(3, 32, 7)
    want = _draft_outputs(load(path), base, held_out)
    err = {}
    for method in ("rtn", "gptq"):
        module, config = load(path), _config()
        H = draft_hessians(module, base, _windows(8, 32, 2), config) if method == "gptq" else None
        quantize_model(module, config, method, hessians=H)
        err[method] = float(((_draft_outputs(module, base, held_out) - want) ** 2).mean())
    assert err["gptq"] < 0.6 * err["rtn"], err  # about 0.3× here


def test_the_cli_quantizes_a_head_on_its_recorded_base_and_it_drafts_losslessly(modules, base, base_dir,
                                                                               tmp_path):
    """`quantize --model HEAD --method gptq --dataset D`: the base the head records, written in the
    provenance; the artifact loads for speculation and greedy output is plain decoding's."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.sampler import SamplingParams
    from quantspec.infer.spec.eagle import EagleProposer, load_eagle3_for_inference

    def greedy(prompts, proposer=None, k=0):
        eng = Engine(base, EngineConfig(block_size=16, max_batch_size=len(prompts), max_length=96,
                                        spec_max_draft_tokens=k), eos_token_ids=[], proposer=proposer)
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
        eng.run()
        return seqs

    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    out = tmp_path / "eagle3.w4"
    r = CliRunner().invoke(main, ["quantize", "--model", str(modules["eagle3"][0]), "--quant-type", "weight_only_int4",
                                  "--group-size", "16", "--method", "gptq", "--dataset", str(data), "--num-samples",
                                  "4", "--seq-len", "32", "--target", "quantspec", "--out", str(out)])
    assert r.exit_code == 0, r.output
    prov = json.loads((out / "quantspec.json").read_text())["provenance"]
    assert prov["calibration"]["base"] == str(base_dir) and prov["method"] == "gptq"
    assert prov["ptq"]["gptq_loss_total"] > 0 and "rtn_linears" not in prov["ptq"]
    head = load_eagle3_for_inference(str(out), base)
    prompts = _windows(2, 12, 3).tolist()
    proposer = EagleProposer(head, max_draft_tokens=3)
    seqs = greedy(prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in greedy(prompts)]
    assert sum(s.stats.drafted for s in seqs) > 0


def test_base_is_given_or_recorded(modules, base, base_dir, tiny_qwen2_dir, tmp_path):
    """A module that records no base needs --base; one that does (quantspec's training, a
    speculators head's verifier) needs none; a base of other sizes is refused by the module's own
    check; --base is for GPTQ of a draft module alone."""
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    gptq = dict(method="gptq", dataset=str(data), num_samples=2, seq_len=16, target="quantspec", **INT4)
    with pytest.raises(QuantSpecError, match="records no base .*--base"):
        api.quantize(str(modules["medusa"][0]), "weight_only_int4", tmp_path / "a", **gptq)
    out = api.quantize(str(modules["medusa"][0]), "weight_only_int4", tmp_path / "b", base=str(base_dir),
                       **gptq)
    assert json.loads((out / "quantspec.json").read_text())["provenance"]["calibration"]["base"] == str(base_dir)
    with pytest.raises(QuantSpecError, match="--base"):
        api.quantize(str(modules["eagle3"][0]), "weight_only_int4", tmp_path / "c", base=str(tiny_qwen2_dir), **gptq)
    with pytest.raises(QuantSpecError, match="--base .*--method rtn of weight_only_int4 reads none"):
        api.quantize(str(modules["eagle3"][0]), "weight_only_int4", tmp_path / "d", base=str(base_dir),
                     target="quantspec")
    with pytest.raises(QuantSpecError, match="not a draft module; drop --base"):
        api.quantize(str(base_dir), "weight_only_int4", tmp_path / "e", base=str(base_dir), **gptq)
    out = api.quantize(str(modules["mtp"][0]), "weight_only_int4", tmp_path / "f", **gptq)
    assert json.loads((out / "quantspec.json").read_text())["provenance"]["calibration"]["base"] == str(base_dir)
    from speculators_heads import write_speculators_head  # a speculators head records its verifier

    head = write_speculators_head(tmp_path / "spec", base.model.embed_tokens.weight.detach(), "llama-plain")
    cfg = json.loads((head / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(base_dir)
    (head / "config.json").write_text(json.dumps(cfg))
    out = api.quantize(str(head), "weight_only_int4", tmp_path / "g", **gptq)
    assert json.loads((out / "quantspec.json").read_text())["provenance"]["calibration"]["base"] == str(base_dir)
    for name in "acde":
        assert not (tmp_path / name).exists()
