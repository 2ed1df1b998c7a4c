"""Mixtures of experts against transformers' own classes: Qwen3-MoE (a router over per-token
top-k experts in place of the MLP, renormalized top-k weights), Qwen2-MoE (unnormalized weights,
plus a sigmoid-gated shared expert, q/k/v biases) and Mixtral (every layer sparse, its own names). quantspec's forward and its engine's greedy
decoding; quantspec's artifacts, whose weights compressed-tensors itself decompresses into a
checkpoint that transformers runs to the same logits; calibration that sees every expert; and the
engines' verdicts on the experts."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.dispatch import DispatchPolicy
from quantspec.infer.loader import load_for_inference
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.moe import SparseMoE, router_ignore
from quantspec.model_zoo.tiny import build_tiny_model
from quantspec.quant.args import QuantType

torch.set_num_threads(1)
IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71, 400, 64, 9])
TOL = dict(rtol=1e-4, atol=1e-4)
EXPERTS = 4


def _tiny_moe(tmp_path_factory, arch):
    """3 layers of 4 experts, top 2: Qwen's 0 and 2 sparse (expert intermediate 64), 1 dense
    (mlp_only_layers); Mixtral's all sparse (expert intermediate 128)."""
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, num_layers=3,
                            moe=None if arch == "mixtral" else {"mlp_only_layers": [1]})


def _sparse(model_dir) -> list[int]:
    args = load_model(model_dir)[0].args
    return [i for i in range(args.num_layers) if args.is_moe_layer(i)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _tiny_moe(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def any_moe_dir(request, tmp_path_factory):
    return _tiny_moe(tmp_path_factory, request.param)


def test_logits_match_transformers_fused_or_not(any_moe_dir, logits_of):
    want = logits_of(any_moe_dir, IDS)
    for fuse in (True, False):
        lm = load_for_inference(any_moe_dir, tokenizer=False, fuse=fuse)
        layers = lm.model.model.layers
        assert [type(x.mlp) is SparseMoE for x in layers] == \
            [True, "mixtral" in any_moe_dir.name, True]
        torch.testing.assert_close(logits_of(lm.model, IDS), want, **TOL)
    model, _ = load_model(any_moe_dir)
    torch.testing.assert_close(logits_of(model, IDS), want, **TOL)
    moe = model.model.layers[0].mlp
    assert (moe.shared_expert is not None) == ("qwen2_moe" in any_moe_dir.name)
    gates = [moe.gate] + ([moe.shared_expert_gate] if moe.shared_expert is not None else [])
    for gate in gates:  # the router decides the routing, the shared gate the shared expert's share
        with torch.no_grad():
            gate.weight.mul_(-1.0)
        assert (logits_of(model, IDS) - want).abs().max() > 1e-2
        with torch.no_grad():
            gate.weight.mul_(-1.0)


def test_every_expert_is_routed_to_and_counts(any_moe_dir, logits_of):
    model, _ = load_model(any_moe_dir)
    moe = model.model.layers[0].mlp
    seen = []
    hooks = [e.register_forward_pre_hook(lambda m, a, i=i: seen.append(i)) for i, e in enumerate(moe.experts)]
    want = logits_of(model, IDS)
    for h in hooks:
        h.remove()
    assert sorted(set(seen)) == list(range(EXPERTS))
    with torch.no_grad():
        moe.experts[int(seen[0])].down_proj.weight.zero_()
    assert (logits_of(model, IDS) - want).abs().max() > 1e-3


def test_engine_greedy_equals_transformers_generate(any_moe_dir, transformers_model, engine_decodes_as_generate):
    engine_decodes_as_generate(any_moe_dir, transformers_model(any_moe_dir))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from quantspec.model_zoo.tiny import TINY_CORPUS

    path = tmp_path_factory.mktemp("moe_corpus") / "corpus.txt"
    path.write_text(TINY_CORPUS * 2)
    return path


@pytest.mark.parametrize("quant_type, options", [
    ("weight_only_int8", {}),
    ("weight_only_int4", {"group_size": 32}),
    ("weight_only_int4", {"group_size": 32, "method": "gptq"}),
    ("weight_only_int4", {"group_size": 32, "method": "awq+gptq"}),  # the router folded, stored float
])
def test_weight_only_artifacts_run_as_compressed_tensors_decompresses_them(any_moe_dir, corpus, tmp_path,
                                                                          quant_type, options, logits_of,
                                                                          ct_decompressed):
    if options.get("method", "rtn") != "rtn":
        options = {**options, "dataset": str(corpus), "num_samples": 8, "seq_len": 32}
    art = api.quantize(str(any_moe_dir), quant_type, tmp_path / "art", **options)
    cfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert set(router_ignore(load_model(any_moe_dir)[0].args)) <= set(cfg["ignore"])
    ref, names = ct_decompressed(art, tmp_path / "dense")
    experts = {n for n in names if ".experts." in n}
    assert len(experts) == len(_sparse(any_moe_dir)) * EXPERTS * 3 and not any(n.endswith(".gate") for n in names)
    shared = {n for n in names if ".shared_expert." in n}  # Qwen2-MoE's shared expert: quantized, its gate not
    assert len(shared) == (2 * 3 if "qwen2_moe" in any_moe_dir.name else 0)
    assert not any(n.endswith("shared_expert_gate") for n in names)
    theirs = logits_of(ref, IDS)
    lm = load_for_inference(art, tokenizer=False)
    torch.testing.assert_close(logits_of(lm.model, IDS), theirs, **TOL)
    assert (logits_of(any_moe_dir, IDS) - theirs).abs().max() > 1e-3  # quantization moved the logits


@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_gptq_quantizes_every_expert_from_every_token(moe_dir, method):
    """Calibration runs every expert on every token (model_zoo.moe.all_experts): GPTQ gives each
    expert's Linears their own loss, none falls back to round-to-nearest."""
    from quantspec.calib.ptq import PartSink, quantize_model
    from quantspec.quant.presets import preset

    model, _ = load_model(moe_dir)
    ids = torch.randint(3, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    config = preset("weight_only_int4", group_size=32, ignore=("lm_head", *router_ignore(model.args)))
    sink = PartSink()
    quantize_model(model, config, method, calib_batches=ids, sink=sink)
    losses = sink.losses
    for layer in (0, 2):
        for e in range(EXPERTS):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            assert f"{p}.gate_proj+{p}.up_proj" in losses and f"{p}.down_proj" in losses


def test_calibration_sees_every_expert_and_static_scales_are_one_per_layer(moe_dir, calibration_table, tmp_path,
                                                                           logits_of, ct_decompressed, ct_scheme_of):
    from quantspec.calib.tables import read_table

    table = read_table(calibration_table(moe_dir), model_dir=moe_dir)
    gate = [float(table.input_absmax(f"model.layers.0.mlp.experts.{e}.gate_proj")) for e in range(EXPERTS)]
    assert min(gate) == max(gate) > 0  # every expert saw every token, not only those routed to it
    art = api.quantize(str(moe_dir), "a8w8_fp8", tmp_path / "fp8", calib=calibration_table(moe_dir))
    t = load_file(str(art / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        s = {float(t[f"model.layers.2.mlp.experts.{e}.{proj}.input_scale"]) for e in range(EXPERTS)}
        assert len(s) == 1  # one input scale per fused-MoE layer and projection, as vLLM runs it
    assert "model.layers.0.mlp.gate.weight" in t and t["model.layers.0.mlp.gate.weight"].is_floating_point()
    # the reference: compressed-tensors' decompressed weights, its fake-quantized FP8 inputs
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    qc = QuantizationConfig.model_validate(json.loads((art / "config.json").read_text())["quantization_config"])
    assert ct_scheme_of(qc, "model.layers.0.mlp.experts.3.down_proj").weights.strategy == "tensor"  # as engines load
    assert ct_scheme_of(qc, "model.layers.0.self_attn.q_proj").weights.strategy == "channel"
    ref, names = ct_decompressed(art, tmp_path / "dense")
    model, _ = load_model(ref)
    for n in names:
        scale, args = t[f"{n}.input_scale"], ct_scheme_of(qc, n).input_activations
        model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, scale=scale, args=args: (fake_quantize(a[0], scale, torch.zeros_like(scale), args),))
    lm = load_for_inference(art, tokenizer=False, policy=DispatchPolicy(fast=False))
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(model, IDS), **TOL)


def test_engine_verdicts_on_experts(moe_dir, calibration_table, tmp_path, transformers_model):
    with pytest.raises(QuantSpecError, match="--target portable: SGLang refused.*NPUs only.*a8w8_fp8"):
        api.quantize(str(moe_dir), "a8w8", tmp_path / "dyn", activations="dynamic")
    dyn = api.quantize(str(moe_dir), "a8w8", tmp_path / "dyn", activations="dynamic", target="vllm")
    verdicts = api.inspect(dyn)["engines"]
    assert verdicts["vllm"]["status"] == "loads" and verdicts["quantspec"]["status"] == "loads"
    assert verdicts["vllm"]["layers"]["model.layers.0.mlp.experts"]["scheme"] == "W8A8Int8MoE"
    assert verdicts["sglang"]["status"] == "refused" and "NPUs only" in verdicts["sglang"]["verdict"]
    assert verdicts["transformers"]["status"] == "refused"
    with pytest.raises(Exception):  # transformers' own loader does refuse the quantized experts
        transformers_model(dyn)
    with pytest.raises(QuantSpecError, match="no MoE kernel takes static int8 activations.*--activations dynamic"):
        api.quantize(str(moe_dir), "a8w8", tmp_path / "static", calib=calibration_table(moe_dir))
    assert not (tmp_path / "static").exists()
    quantspec_only = api.quantize(str(moe_dir), "a8w8", tmp_path / "qs", calib=calibration_table(moe_dir),
                                  target="quantspec")
    assert api.inspect(quantspec_only)["engines"]["vllm"]["status"] == "refused"
    shutil.rmtree(quantspec_only)
    # one expert left float: the engines run every expert with expert 0's scheme
    skip_one = ("re:.*experts\\.0\\..*",)
    with pytest.raises(QuantSpecError, match="experts were quantized with different schemes"):
        api.quantize(str(moe_dir), "weight_only_int8", tmp_path / "skip", ignore=skip_one)
    mixed = api.quantize(str(moe_dir), "weight_only_int8", tmp_path / "skip", ignore=skip_one, target="quantspec")
    verdicts = api.inspect(mixed)["engines"]
    assert verdicts["vllm"]["status"] == verdicts["sglang"]["status"] == "refused"
    assert verdicts["quantspec"]["status"] == "loads"


def test_w4a8_expert_verdicts_judge_the_model_s_sizes(moe_dir, tmp_path):
    """int4 experts with 8-bit inputs: vLLM's W4AFP8 experts need groups of 128 and hidden / expert
    sizes that are multiples of 256, judged on the model's own sizes before any work; int8 inputs
    it runs on CPUs only; SGLang's quantize the inputs with one FP8 scale per tensor (`inspect`)."""
    from quantspec.quant.engines import engine_verdicts
    from quantspec.quant.presets import preset

    with pytest.raises(QuantSpecError, match=r"multiples of 256 \(hidden size 64, intermediate size 64\)"):
        api.quantize(str(moe_dir), "a8w4_fp8", tmp_path / "fp8", group_size=128, target="vllm")
    assert not (tmp_path / "fp8").exists()
    layer = "model.layers.0.mlp.experts"

    def verdicts(qt, group, hidden, inter, capability=90):  # one layer of two experts
        config = preset(QuantType(qt), group_size=group)
        linears = {f"{layer}.{e}.{p}": inter if p == "down_proj" else hidden
                   for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
        return engine_verdicts(config, linears, capability=capability)

    v = verdicts("a8w4_fp8", 128, 2048, 768)
    assert (v["vllm"].status, v["vllm"].layers[layer].scheme) == ("loads", "W4A8Fp8MoE")
    assert v["sglang"].status == "ignores" and "one dynamic scale per tensor" in v["sglang"].reasons[0]
    assert "multiples of 256 (intermediate size 1408)" in verdicts("a8w4_fp8", 128, 2048, 1408)["vllm"].reasons[0]
    assert "groups of 128 only" in verdicts("a8w4_fp8", 64, 2048, 768)["vllm"].reasons[0]
    assert "Humming" in verdicts("a8w4_fp8", 128, 2048, 768, capability=70)["vllm"].reasons[0]
    assert verdicts("a8w4_fp8", 128, 2048, 768, capability=80)["vllm"].status == "loads"
    assert "compute capability 9.0" in verdicts("a8w4_fp8", 128, 2048, 768, capability=80)["sglang"].reasons[0]
    int8 = verdicts("a8w4", 128, 2048, 768)
    assert int8["vllm"].status == "refused" and "CPUs only" in int8["vllm"].reasons[0]
    assert any("a8w4_fp8" in f for f in int8["vllm"].fixes)
    assert "int8 input quantization" in int8["sglang"].reasons[0] and int8["sglang"].layers[layer].scheme == "W4AFP8MoE"


def test_speculation_on_a_moe_base_keeps_plain_greedy(any_moe_dir, tmp_path):
    """n-gram drafts, an MTP module and an EAGLE-3 head (dense layers over the MoE base's
    features; the EAGLE-3 head as vLLM and SGLang load it) leave greedy answers as plain
    decoding's."""
    from quantspec.infer.predictor import InferConfig, Predictor
    from quantspec.model_zoo.eagle3 import save_eagle3
    from quantspec.model_zoo.eagle3_train import init_eagle3
    from quantspec.model_zoo.mtp import save_mtp
    from quantspec.model_zoo.mtp_train import init_mtp

    base, _ = load_model(any_moe_dir)
    head = save_eagle3(init_eagle3(base, torch.arange(0, 512, 2), (0, 1, 3)), tmp_path / "eagle3")
    mtp = save_mtp(init_mtp(base, torch.arange(base.args.vocab_size), seed=0), tmp_path / "mtp")
    for draft in (head, mtp):  # dense draft layers, whatever the base
        assert "experts" not in (draft / "model.safetensors").read_bytes()[:20000].decode("latin-1")
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def quantize(x, scale):"]
    runs = {}
    for method, extra in (("none", {}), ("inference_with_reference", {}), ("mtp", {"draft_model": str(mtp)}),
                          ("eagle", {"draft_model": str(head), "speculate_tree": "2x2"})):
        config = InferConfig(model=str(any_moe_dir), max_new_tokens=24, max_length=128, speculate_method=method,
                             **extra)
        runs[method] = [o.token_ids for o in Predictor(config).generate(prompts)]
    assert runs["inference_with_reference"] == runs["mtp"] == runs["eagle"] == runs["none"]


def test_routing_settings_are_part_of_the_model_s_fingerprint(moe_dir, tmp_path):
    """A calibration table or artifact of a model is refused for the same weights routed otherwise
    (another top-k): the routing settings are in the fingerprint, as the weights are."""
    from quantspec.model_zoo.checkpoint import model_fingerprint

    other = tmp_path / "top1"
    shutil.copytree(moe_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_experts_per_tok"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(other) != model_fingerprint(moe_dir)
