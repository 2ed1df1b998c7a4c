"""GPTQ and AWQ checkpoints in AutoGPTQ's / GPTQModel's and AutoAWQ's own formats (`quant.autoquant`),
written here with plain numpy by the layouts vLLM's own test utilities pack them in (`gptq_pack`:
codes of consecutive rows in a word; `awq_pack`: columns interleaved [0, 2, 4, 6, 1, 3, 5, 7], then
codes of consecutive columns in a word), from codes and scales the test chose. quantspec runs them
with the writer's weights ((q − z) · s) and the logits transformers gives those weights, leaves
float what the config leaves float, quantizes from them (desc_act's permuted groups too, which it
refuses to run, as vLLM does), and refuses in one line what vLLM refuses."""

import json
import shutil
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.loader import auto_dtype, load_for_inference
from quantspec.infer.quant_linear import QuantLinear
from quantspec.quant.artifact import load_safetensors

IDS = torch.tensor([7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from quantspec.model_zoo.tiny import TINY_CORPUS

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TINY_CORPUS * 2)
    return path
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ("w1", "w2", "w3")  # Mixtral's experts' gate / down / up


def _pack_rows(q: numpy.ndarray, bits: int) -> torch.Tensor:
    """vLLM's `pack_rows`: q [K, N] unsigned → int32 [K / (32 / bits), N]."""
    per = 32 // bits
    out = numpy.zeros((q.shape[0] // per, q.shape[1]), dtype=numpy.uint32)
    for i in range(per):
        out |= q[i::per, :].astype(numpy.uint32) << (bits * i)
    return torch.from_numpy(out.astype(numpy.int32))


def _pack_cols_awq(q: numpy.ndarray) -> torch.Tensor:
    """vLLM's `awq_pack` (4 bits): q [R, N] unsigned → int32 [R, N / 8]."""
    q = q.reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(q.shape)
    out = numpy.zeros((q.shape[0], q.shape[1] // 8), dtype=numpy.uint32)
    for i in range(8):
        out |= q[:, i::8].astype(numpy.uint32) << (4 * i)
    return torch.from_numpy(out.astype(numpy.int32))


def _codes(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor | None = None):
    """RTN of w [N, K] in groups along K (of the columns in the order `perm`, desc_act's, when
    given) → (q [K, N] unsigned, scales [G, N] fp16, zeros [G, N] or None, the dequantized weight
    [N, K] (q − z) · s, exact in fp32)."""
    if perm is not None:
        inv = torch.argsort(perm)
        q, s, z, deq = _codes(w[:, perm], bits, group, sym)
        return q[inv.numpy()], s, z, deq[:, inv]
    N, K = w.shape
    g = K if group == -1 else group
    wg = w.float().reshape(N, K // g, g)
    top = (1 << bits) - 1
    if sym:
        s = (wg.abs().amax(-1) / ((top + 1) // 2 - 0.5)).clamp(min=1e-6).half()
        z = torch.full_like(s, (top + 1) // 2, dtype=torch.float32)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).clamp(min=1e-6).half()
        z = (-lo / s.float()).round().clamp(0, top)
    q = (wg / s.float()[..., None] + z[..., None]).round().clamp(0, top)
    deq = ((q - z[..., None]) * s.float()[..., None]).reshape(N, K)  # exact in fp32
    return (q.reshape(N, K).t().to(torch.int32).numpy(), s.t().contiguous(),
            None if sym else z.t().to(torch.int32).numpy(), deq)


def _write(src: Path, out: Path, method: str, bits: int = 4, group: int = 32, skip: tuple[str, ...] = (),
           lm_head: bool = False, desc_act: bool = False, modules: dict | None = None,
           dynamic: dict | None = None) -> dict[str, torch.Tensor]:
    """`src` as a GPTQ (symmetric; `desc_act`: groups of columns in a random order, its `g_idx`
    permuted) or AWQ (zero points) checkpoint → {Linear: its dequantized weight}. `modules`: Linear →
    its own (bits, group), or None to store it float, as GPTQModel's `dynamic` rules (written to
    the config) give it."""
    shutil.copytree(src, out)
    tensors, dense = load_file(str(out / "model.safetensors")), {}
    names = [k[:-len(".weight")] for k in tensors if k.endswith(".weight") and
             (k.rsplit(".", 2)[-2] in LINEARS + MIXTRAL_EXPERTS or (lm_head and k == "lm_head.weight"))]
    for n in names:
        own = (modules or {}).get(n, (bits, group))
        if any(s in n for s in skip) or own is None:
            continue
        w = tensors.pop(f"{n}.weight")
        perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(len(dense))) if desc_act else None
        nb, ng = own
        q, s, z, dense[n] = _codes(w, nb, ng, sym=method == "gptq", perm=perm)
        tensors[f"{n}.scales"] = s
        if method == "gptq":
            tensors[f"{n}.qweight"] = _pack_rows(q, nb)
            g = q.shape[0] if ng == -1 else ng
            # AutoGPTQ's zeros, stored less one (unused: symmetric)
            tensors[f"{n}.qzeros"] = _pack_rows(numpy.full((q.shape[1], q.shape[0] // g), (1 << (nb - 1)) - 1),
                                                nb).t().contiguous()
            order = torch.arange(q.shape[0]) if perm is None else torch.argsort(perm)  # column k's rank
            tensors[f"{n}.g_idx"] = (order // g).to(torch.int32)
        else:
            tensors[f"{n}.qweight"], tensors[f"{n}.qzeros"] = _pack_cols_awq(q), _pack_cols_awq(z)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                                  "sym": True, "lm_head": lm_head, "damp_percent": 0.01,
                                  "checkpoint_format": "gptq", **({"dynamic": dynamic} if dynamic else {})} \
        if method == "gptq" else \
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": list(skip) or None}
    (out / "config.json").write_text(json.dumps(cfg))
    return dense


def _dense_checkpoint(src: Path, out: Path, dense: dict) -> Path:
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({f"{n}.weight": w.float() for n, w in dense.items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("method, bits, group, skip, lm_head", [
    ("gptq", 4, 32, (), False),
    ("gptq", 8, 32, (), True),
    ("gptq", 4, -1, (), False),
    ("awq", 4, 32, (), False),
    ("awq", 4, 16, ("down_proj",), False),
])
def test_we_run_gptq_and_awq_checkpoints(tiny_llama_dir, tmp_path, logits_of, method, bits, group, skip, lm_head):
    dense = _write(tiny_llama_dir, tmp_path / method, method, bits, group, skip, lm_head)
    lm = load_for_inference(tmp_path / method, tokenizer=False, fuse=False)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(layers) == sorted(dense) and len(layers) == (7 - len(skip)) * 2 + lm_head
    for name, m in layers.items():
        assert m.weight_args.num_bits == bits and m.weight_args.symmetric == (method == "gptq")
        assert torch.equal(m.dequantized_weight(torch.float32), dense[name].float()), name
    assert not any(s in n for n in layers for s in skip)  # left float
    ref = _dense_checkpoint(tiny_llama_dir, tmp_path / "dense", dense)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)
    assert auto_dtype(tmp_path / method) == torch.bfloat16
    info = api.inspect(tmp_path / method)
    assert info["format"].startswith(method) and info["quant_type"] == f"weight_only_int{bits}"
    assert len(info["layers"]) == len(layers)


# GPTQModel's per-module rules, first match deciding: layer 0 at 8 bits (its up_proj too, though the
# negative rule after it names it), every other up_proj float, down_proj in groups of 16
NAMES = [f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for i in range(2) for p in LINEARS]
DYNAMIC = {"+:.*layers\\.0\\..*": {"bits": 8}, "-:.*up_proj": {}, ".*down_proj": {"group_size": 16}}


def _dynamic_modules(names) -> dict:
    """What `DYNAMIC` gives each Linear, written out by hand: (bits, group), or None (float)."""
    return {n: (8, 32) if ".layers.0." in n else None if n.endswith("up_proj") else
            (4, 16) if n.endswith("down_proj") else (4, 32) for n in names}


def _assert_runs_as_written(src: Path, ckpt: Path, modules: dict, dense: dict, logits_of) -> None:
    """The checkpoint at `ckpt` (written by `_write` from `src`) runs each Linear with the (bits,
    group) `modules` gives it, the ones it gives None float, its weights exactly `dense`'s, and the
    logits of those weights (their float checkpoint's, beside `ckpt`)."""
    lm = load_for_inference(ckpt, tokenizer=False, fuse=False)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(layers) == sorted(n for n, own in modules.items() if own is not None) == sorted(dense)
    for name, m in layers.items():
        assert (m.weight_args.num_bits, m.weight_args.group_size) == modules[name], name
        assert torch.equal(m.dequantized_weight(torch.float32), dense[name].float()), name
    ref = _dense_checkpoint(src, ckpt.parent / f"{ckpt.name}.dense", dense)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)


def test_gptqmodel_dynamic_rules_give_each_module_its_own_scheme(tiny_llama_dir, tmp_path, logits_of):
    """A GPTQModel checkpoint with per-module rules (`dynamic`) runs with each Linear's own bits and
    group size, the ones a negative rule names stay float, and its logits are those of its weights."""
    modules = _dynamic_modules(NAMES)
    dense = _write(tiny_llama_dir, tmp_path / "gptq", "gptq", modules=modules, dynamic=DYNAMIC)
    _assert_runs_as_written(tiny_llama_dir, tmp_path / "gptq", modules, dense, logits_of)
    info = api.inspect(tmp_path / "gptq")
    assert {n: (d["bits"], d["group_size"]) for n, d in info["layers"].items()} == \
        {n: own for n, own in modules.items() if own is not None}


# an AutoRound config's per-layer settings and what they give each Linear, written out by hand
AUTOROUND = {"block_name_to_quantize": "model.layers", "extra_config": {
    "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 16}, r".*layers\.1\.self_attn\.o_proj": {"bits": 16},
    r".*\.up_proj": {"group_size": 16}}}


def _autoround_modules(names, method) -> dict:
    return {n: (8, 16) if n == "model.layers.0.mlp.down_proj" and method == "gptq" else
            None if n == "model.layers.1.self_attn.o_proj" else (4, 16) if n.endswith("up_proj") else (4, 32)
            for n in names}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_autoround_checkpoints_run_with_each_layer_s_settings(tiny_llama_dir, tmp_path, logits_of, method):
    """An AutoRound checkpoint (AutoGPTQ's layout or AutoAWQ's) with per-layer settings
    (`extra_config`: a full name, regexes, 16 bits for float) runs each Linear with its own bits and
    group size, and gives the logits of its weights."""
    modules = _autoround_modules(NAMES, method)
    dense = _write(tiny_llama_dir, tmp_path / "ar", method, modules=modules)
    cfg = json.loads((tmp_path / "ar" / "config.json").read_text())
    extra = dict(AUTOROUND["extra_config"])
    if method == "awq":  # AutoAWQ's layout holds 4-bit codes only
        del extra["model.layers.0.mlp.down_proj"]
    cfg["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": method == "gptq",
                                  "data_type": "int", "packing_format": f"auto_round:auto_{method}", "iters": 200,
                                  **AUTOROUND, "extra_config": extra}
    (tmp_path / "ar" / "config.json").write_text(json.dumps(cfg))
    _assert_runs_as_written(tiny_llama_dir, tmp_path / "ar", modules, dense, logits_of)
    assert api.inspect(tmp_path / "ar")["format"].startswith("auto-round")


def test_autoround_block_fp8_is_transformers_fp8_layout(tiny_llama_dir, tmp_path, logits_of):
    """AutoRound's block FP8 (`data_type: "fp"`, a [rows, columns] group_size) holds transformers'
    FP8 tensors (`weight`, `weight_scale_inv` per block): quantspec runs it as that checkpoint
    (dequantized weights exact, blocks and input groups as declared), a 16-bit `extra_config` entry
    float, and refuses in one line the input settings vLLM asserts against."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quantspec_test_interop_helpers_ar",
                                                  Path(__file__).parent / "test_interop_transformers.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    dense = helpers._write_hf_fp8(tiny_llama_dir, tmp_path / "ar", (32, 32))
    kept = "model.layers.1.mlp.down_proj"  # float: its 16-bit entry
    tensors = load_file(str(tmp_path / "ar" / "model.safetensors"))
    tensors[f"{kept}.weight"] = load_file(str(tiny_llama_dir / "model.safetensors"))[f"{kept}.weight"]
    del tensors[f"{kept}.weight_scale_inv"], dense[kept]
    save_file(tensors, str(tmp_path / "ar" / "model.safetensors"))
    cfg = json.loads((tmp_path / "ar" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "auto-round", "bits": 8, "group_size": [32, 32], "sym": True,
                                  "data_type": "fp", "packing_format": "auto_round:fp8", "act_bits": 8,
                                  "act_group_size": 32, "act_data_type": "fp", "act_dynamic": True, "act_sym": True,
                                  "fmt": "e4m3", "activation_scheme": "dynamic", "block_name_to_quantize": "model.layers",
                                  "extra_config": {kept: {"bits": 16}}}
    (tmp_path / "ar" / "config.json").write_text(json.dumps(cfg))
    lm = load_for_inference(tmp_path / "ar", tokenizer=False, fuse=False)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(layers) == sorted(dense)
    for name, m in layers.items():
        assert m.weight_args.block_structure == (32, 32) and m.input_args.group_size == 32
        assert torch.equal(m.dequantized_weight(torch.float32), dense[name]), name
    for m in layers.values():  # with float inputs: the logits of its weights
        m.input_args = None
    ref = _dense_checkpoint(tiny_llama_dir, tmp_path / "dense", dense)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)
    cfg["quantization_config"]["act_group_size"] = 64
    (tmp_path / "ar" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="act_group_size") as e:
        load_for_inference(tmp_path / "ar", tokenizer=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit, named", [
    ({"data_type": "mx_fp"}, "data_type 'mx_fp'"),
    ({"packing_format": "auto_round"}, "packing_format 'auto_round'"),
    ({"sym": False}, "asymmetric weights in AutoGPTQ's layout"),
    ({"act_bits": 8}, "act_bits 8"),
    ({"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 3}}}, "down_proj'\\]: 3-bit"),
    ({"extra_config": {"(": {}}}, "is not a regex"),
])
def test_autoround_configs_quantspec_does_not_read_are_one_line(tiny_llama_dir, tmp_path, edit, named):
    _write(tiny_llama_dir, tmp_path / "ar", "gptq")
    cfg = json.loads((tmp_path / "ar" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True, **edit}
    (tmp_path / "ar" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match=named) as e:
        load_for_inference(tmp_path / "ar", tokenizer=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_mixture_of_experts_checkpoints_keep_their_float_routers(tmp_path, logits_of, arch, method):
    """A GPTQ / AWQ checkpoint of a mixture of experts (experts and attention quantized, the routers
    and Qwen2-MoE's shared-expert gate stored float, no module list in the config): the Linears
    stored float run float, as vLLM reads them by their tensors' dtypes, and the logits are those
    of the checkpoint's weights (transformers' own run of the float checkpoint)."""
    from quantspec.model_zoo.tiny import build_tiny_model

    src = build_tiny_model(tmp_path / arch, arch, num_layers=2)
    dense = _write(src, tmp_path / method, method)
    assert any(".experts." in n for n in dense) and not any(n.endswith(("mlp.gate", "gate.weight")) for n in dense)
    lm = load_for_inference(tmp_path / method, tokenizer=False, fuse=False)
    layers = {n for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)}
    assert layers == set(dense)
    ref = _dense_checkpoint(src, tmp_path / "dense", dense)
    torch.testing.assert_close(logits_of(lm.model, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rules", [None, DYNAMIC], ids=["one-scheme", "dynamic"])
def test_quantizing_from_gptq_equals_quantizing_its_weights(tiny_llama_dir, tmp_path, rules):
    dense = _write(tiny_llama_dir, tmp_path / "gptq", "gptq", modules=rules and _dynamic_modules(NAMES), dynamic=rules)
    ref = _dense_checkpoint(tiny_llama_dir, tmp_path / "dense", dense)
    a, b = (api.quantize(str(src), "weight_only_int8", tmp_path / f"w8_{i}") for i, src in
            enumerate((tmp_path / "gptq", ref)))
    ta, tb = load_safetensors(a), load_safetensors(b)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_desc_act_is_refused_where_run_and_requantized_into_static_groups(tiny_llama_dir, tmp_path, corpus):
    """A permuted g_idx (desc_act), which vLLM no longer runs: one line naming the command that
    re-quantizes it; that command decompresses it column by column, as the float checkpoint of
    its weights quantizes."""
    from quantspec.quant.decompressed import DecompressedReader

    dense = _write(tiny_llama_dir, tmp_path / "gptq", "gptq", desc_act=True)
    with pytest.raises(QuantSpecError, match="desc_act.*--method gptq --act-order") as e:
        load_for_inference(tmp_path / "gptq", tokenizer=False)
    assert "\n" not in str(e.value)
    reader = DecompressedReader(tmp_path / "gptq")
    assert len(reader.view.plan.permuted) == 14
    for n, w in dense.items():
        assert torch.equal(reader.read([f"{n}.weight"])[f"{n}.weight"], w), n
    ref = _dense_checkpoint(tiny_llama_dir, tmp_path / "dense", dense)
    options = dict(method="gptq", act_order=True, group_size=32, dataset=str(corpus), num_samples=4, seq_len=32)
    a, b = (api.quantize(str(src), "weight_only_int4", tmp_path / f"w4_{i}", **options)
            for i, src in enumerate((tmp_path / "gptq", ref)))
    ta, tb = load_safetensors(a), load_safetensors(b)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert load_for_inference(a, tokenizer=False).quant_config.quant_type.value == "weight_only_int4"


@pytest.mark.parametrize("edit, named", [
    ({"sym": False}, "sym: false"),
    ({"bits": 3}, "bits 3"),
    ({"dynamic": {"+:.*down_proj": {"bits": 3}}}, "dynamic rule '\\+:.\\*down_proj': bits 3"),
    ({"dynamic": {".*down_proj": {"sym": False}}}, "dynamic rule '.\\*down_proj': asymmetric"),
    ({"dynamic": {"-:.*(down": {}}}, "is not a regex"),
    ({"dynamic": {".*down_proj": 8}}, "dynamic must map module regexes"),
    ({"quant_method": "awq", "version": "gemv", "zero_point": True}, "version 'gemv'"),
])
def test_what_vllm_refuses_is_one_line(tiny_llama_dir, tmp_path, edit, named):
    _write(tiny_llama_dir, tmp_path / "gptq", "gptq")
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match=named) as e:
        load_for_inference(tmp_path / "gptq", tokenizer=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method, leaf", [("awq", "scales"), ("awq", "qzeros"), ("gptq", "scales")])
def test_a_missing_tensor_is_named_as_stored(tiny_llama_dir, tmp_path, method, leaf):
    _write(tiny_llama_dir, tmp_path / method, method)
    tensors = load_file(str(tmp_path / method / "model.safetensors"))
    del tensors[f"model.layers.1.mlp.up_proj.{leaf}"]
    save_file(tensors, str(tmp_path / method / "model.safetensors"))
    with pytest.raises(QuantSpecError, match=f"'model.layers.1.mlp.up_proj.{leaf}' is missing") as e:
        load_for_inference(tmp_path / method, tokenizer=False)
    assert "\n" not in str(e.value)
