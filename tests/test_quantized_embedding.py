"""A quantized input embedding: `quantize --layer-quant-type model.embed_tokens=TYPE`.

The embedding's rows are rounded to nearest (integer, symmetric, pack-quantized: the layout vLLM
looks up) under every method; a tied model is untied (the head a float copy of the source
embedding unless a target names it too). References: the source checkpoint's own tensors,
compressed-tensors' own decompression of what quantspec stored, transformers' logits on that
decompressed checkpoint, and the same run without the embedding quantized.
"""

import json
from pathlib import Path

import pytest
import torch

from artifact_files import hf_logits, tensors as _tensors
from quantspec import api
from quantspec.errors import QuantSpecError
from quantspec.infer.loader import load_for_inference
from quantspec.infer.quant_embedding import QuantEmbedding
from quantspec.model_zoo.attention import DenseCausalAttention
from quantspec.model_zoo.tiny import TINY_CORPUS

pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is not installed")

IDS = torch.tensor([[7, 300, 41, 12, 99, 5, 260, 17, 33, 2, 150, 8, 71]])
EMBED = "model.embed_tokens"


def _our_logits(path: Path) -> torch.Tensor:
    lm = load_for_inference(path, tokenizer=False)
    assert isinstance(lm.model.model.embed_tokens, QuantEmbedding)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(IDS[0], torch.arange(IDS.shape[1]), DenseCausalAttention(1, IDS.shape[1])))


@pytest.mark.parametrize("emb_type,group", [("weight_only_int8", None), ("weight_only_int4", 32)])
def test_tied_embedding_is_untied_and_quantized(tied_llama_dir, tmp_path, ct_decompressed, emb_type, group):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, target="vllm",
                       layer_quant_types=(f"{EMBED}={emb_type}",))
    plain = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "plain", group_size=32)
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    ours, src = _tensors(art), _tensors(tied_llama_dir)
    # the head: the source embedding, float and bit for bit; the embedding: packed codes only
    assert torch.equal(ours["lm_head.weight"], src["model.embed_tokens.weight"])
    assert f"{EMBED}.weight" not in ours and ours[f"{EMBED}.weight_packed"].dtype == torch.int32
    assert f"{EMBED}.weight_zero_point" not in ours
    for k, t in _tensors(plain).items():  # the decoder layers are quantized as without it
        if k.startswith("model.layers."):
            assert torch.equal(ours[k], t), k
    # compressed-tensors' own decompression: each row rounded to nearest on its grid
    dec, names = ct_decompressed(art, tmp_path / "dec")
    assert EMBED in names
    w, e = _tensors(dec)[f"{EMBED}.weight"].float(), src["model.embed_tokens.weight"].float()
    scale = ours[f"{EMBED}.weight_scale"].float()
    step = scale.repeat_interleave(group, dim=1) if group else scale
    inside = e.abs() <= (7 if group else 127) * step
    assert inside.float().mean() > 0.9
    assert ((w - e).abs() <= step / 2 + 1e-6)[inside].all()
    assert not torch.equal(w, e)
    # quantspec looks the rows up as compressed-tensors decompresses them, and runs the artifact
    # as transformers runs the decompressed checkpoint
    lm = load_for_inference(art, tokenizer=False)
    emb = lm.model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and emb.packed.dtype == torch.int32
    torch.testing.assert_close(emb(IDS[0]), w[IDS[0]], rtol=0, atol=0)
    torch.testing.assert_close(_our_logits(art), hf_logits(dec, IDS), rtol=1e-4, atol=1e-4)


def test_embedding_and_head_both_quantized(tied_llama_dir, tmp_path):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, target="vllm",
                       layer_quant_types=(f"{EMBED}=weight_only_int4", "lm_head=weight_only_int8"))
    ours = _tensors(art)
    assert not any(k in ours for k in ("lm_head.weight", f"{EMBED}.weight"))
    assert ours["lm_head.weight_packed"].shape != ours[f"{EMBED}.weight_packed"].shape  # int8 vs int4 codes
    assert json.loads((art / "config.json").read_text())["tie_word_embeddings"] is False
    plain = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "plain", group_size=32)
    size = lambda p: (p / "model.safetensors").stat().st_size  # noqa: E731
    assert size(art) < size(plain)  # the float table (tied: once) against int4 rows + an int8 head
    assert _our_logits(art).shape == (IDS.shape[1], 512)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_untied_model_keeps_its_head_and_rounds_the_embedding_under_data_methods(tiny_llama_dir, tmp_path, method):
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    art = api.quantize(str(tiny_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, method=method,
                       dataset=str(data), num_samples=4, seq_len=32, target="vllm",
                       layer_quant_types=(f"{EMBED}=weight_only_int8",))
    ours, src = _tensors(art), _tensors(tiny_llama_dir)
    assert torch.equal(ours["lm_head.weight"], src["lm_head.weight"])
    e = src[f"{EMBED}.weight"].float()
    s = (e.abs().amax(1, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).eps)  # (q_max - q_min) / 2
    assert torch.allclose(ours[f"{EMBED}.weight_scale"].float(), s, rtol=1e-6)
    assert json.loads((art / "quantspec.json").read_text())["provenance"]["ptq"]["rtn_linears"] == [EMBED]


def test_engine_verdicts_and_targets(tied_llama_dir, tmp_path):
    opts = dict(group_size=32, layer_quant_types=(f"{EMBED}=weight_only_int4",))
    for target, engine in (("portable", "SGLang"), ("sglang", "SGLang"), ("transformers", "transformers")):
        with pytest.raises(QuantSpecError, match=rf"--target {target}: {engine} refused because .*embed"):
            api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / target, target=target, **opts)
        assert not (tmp_path / target).exists()
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", target="vllm", **opts)
    engines = api.inspect(art)["engines"]
    assert engines["vllm"]["status"] == "loads" and engines["quantspec"]["status"] == "loads"
    assert engines["sglang"]["status"] == engines["transformers"]["status"] == "refused"


@pytest.mark.parametrize("spec,extra,match", [
    (f"{EMBED}=a8w8", {}, "names the embedding .* takes weight_only_int8 or weight_only_int4"),
    (f"{EMBED}=weight_only_int8", {"symmetric": False}, "whose codes are symmetric .* drop --asym"),
    ("re:.*embed.*=weight_only_nvfp4", {}, "names the embedding"),
])
def test_bad_embedding_types_are_refused(tied_llama_dir, tmp_path, spec, extra, match):
    with pytest.raises(QuantSpecError, match=match):
        api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", target="vllm",
                     layer_quant_types=(spec,), **extra)
    assert not (tmp_path / "a").exists()


def test_a_quantized_embedding_the_head_is_tied_to_is_refused(tied_llama_dir, tmp_path):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, target="vllm",
                       layer_quant_types=(f"{EMBED}=weight_only_int8",))
    cfg = json.loads((art / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantSpecError, match="ties the output head to it .* no float weights"):
        load_for_inference(art, tokenizer=False)


def test_out_of_range_ids_are_refused(tied_llama_dir, tmp_path):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, target="vllm",
                       layer_quant_types=(f"{EMBED}=weight_only_int4",))
    emb = load_for_inference(art, tokenizer=False).model.model.embed_tokens
    with pytest.raises(IndexError, match="token id out of range"):
        emb(torch.tensor([0, 512]))
    assert emb(torch.tensor([[3, 4], [5, 6]])).shape == (2, 2, emb.embedding_dim)


def _config(embed: dict, fmt: str = "pack-quantized", target: str = EMBED):
    from quantspec.quant.config import QuantConfig

    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 64, "strategy": "group"}
    return QuantConfig.from_dict({
        "quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": int4, "format": "pack-quantized"},
                          "group_1": {"targets": [target], "weights": embed, "format": fmt}}})


@pytest.mark.parametrize("embed,fmt,target,vllm,quantspec", [
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "pack-quantized", EMBED,
     "loads", "loads"),
    # the class target: vLLM's class-name match ("Embedding" in "VocabParallelEmbedding")
    ({"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group"}, "pack-quantized",
     "Embedding", "loads", "loads"),
    ({"num_bits": 4, "type": "int", "symmetric": False, "group_size": 32, "strategy": "group"}, "pack-quantized",
     EMBED, "refused", "loads"),  # no zero point in vLLM's lookup
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "int-quantized", EMBED,
     "refused", "loads"),  # vLLM reads weight_packed only
    ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "float-quantized", EMBED,
     "refused", "refused"),
])
def test_verdicts_on_embedding_schemes(embed, fmt, target, vllm, quantspec):
    from quantspec.quant.engines import engine_verdicts

    linears = {"model.layers.0.self_attn.o_proj": 256, EMBED: 256}
    v = engine_verdicts(_config(embed, fmt, target), linears)
    assert v["vllm"].status == vllm, v["vllm"].line()
    assert v["quantspec"].status == quantspec, v["quantspec"].line()
    assert v["sglang"].status == v["transformers"].status == "refused"
    if vllm == "loads":
        assert v["vllm"].layers[EMBED].scheme == "EmbeddingWNA16Int"


def test_requantizing_reads_the_embedding_decompressed(tied_llama_dir, tmp_path):
    art = api.quantize(str(tied_llama_dir), "weight_only_int4", tmp_path / "a", group_size=32, target="vllm",
                       layer_quant_types=(f"{EMBED}=weight_only_int4",))
    again = api.quantize(str(art), "weight_only_int8", tmp_path / "b")
    rows = load_for_inference(art, tokenizer=False, dtype=torch.float32).model.model.embed_tokens.dequantized()
    torch.testing.assert_close(_tensors(again)[f"{EMBED}.weight"].float(), rows, rtol=0, atol=0)
    # GPTQ from it: the calibration windows' rows are looked up in the decompressed table
    data = tmp_path / "calib.txt"
    data.write_text(TINY_CORPUS)
    gptq = api.quantize(str(art), "weight_only_int4", tmp_path / "c", group_size=32, method="gptq",
                        dataset=str(data), num_samples=4, seq_len=32)
    torch.testing.assert_close(_tensors(gptq)[f"{EMBED}.weight"].float(), rows, rtol=0, atol=0)
