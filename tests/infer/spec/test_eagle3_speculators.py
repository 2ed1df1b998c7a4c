"""EAGLE-3 heads in the speculators format (vllm-project/speculators): read with their layer
variants (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`, a Qwen3 decoder
layer, any number of aux layers) and checked against speculators' model written with
transformers' own decoder layer, rotary embedding and norms; drafting with one keeps greedy output
plain; quantized on its own into the plain layout with the variants' flags; refused in one line
where quantspec does not read it."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantspec.errors import QuantSpecError
from quantspec.infer.spec.eagle import EagleProposer, load_eagle3_for_inference
from quantspec.infer.spec.tree import TreeSpec
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3 import causal_attend, load_eagle3
from speculators_heads import VARIANTS, write_speculators_head

from test_spec_eagle import _prompts, _run

torch.set_num_threads(1)


def _layer_classes(kind: str) -> tuple:
    """transformers' (config, decoder layer, norm, rotary embedding) of a `kind` layer; imported
    here, not at collection: transformers' modeling modules import triton, which the kernel tests
    must import first (tests/kernels/conftest.py)."""
    if kind == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        return LlamaConfig, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

    return Qwen3Config, Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


def _write(path, base, variant, **kw):
    return write_speculators_head(path, kw.pop("embed", base.model.embed_tokens.weight.detach()), variant, **kw)


class SpeculatorsReference(nn.Module):
    """speculators' EAGLE-3 draft model (models/eagle3: `Eagle3FirstLayerMixin` over transformers'
    decoder layer, then the final norm and lm_head), built from transformers' classes."""

    def __init__(self, path, embed: torch.Tensor):
        super().__init__()
        from safetensors.torch import load_file

        cfg = json.loads((path / "config.json").read_text())
        self.cfg, self.embed = cfg, embed
        tl = dict(cfg["transformer_layer_config"])
        config_cls, layer_cls, norm_cls, rotary_cls = _layer_classes(tl.pop("model_type"))
        c = config_cls(**tl)
        c._attn_implementation = "eager"
        D, n = c.hidden_size, len(cfg["eagle_aux_hidden_state_layer_ids"])
        layer = layer_cls(c, 0)
        for s, out in (("q", c.num_attention_heads), ("k", c.num_key_value_heads), ("v", c.num_key_value_heads)):
            setattr(layer.self_attn, f"{s}_proj", nn.Linear(2 * D, out * c.head_dim, bias=False))
        layer.hidden_norm = norm_cls(D, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.rotary = rotary_cls(c)
        self.norm = norm_cls(D, eps=c.rms_norm_eps)
        self.fc = nn.Linear(n * D, D, bias=False)
        self.lm_head = nn.Linear(D, cfg["draft_vocab_size"], bias=False)
        if cfg.get("norm_before_fc"):
            self.input_norm = norm_cls(n * D, eps=c.rms_norm_eps)
        if cfg.get("fc_norm"):
            self.fc_norm = nn.ModuleList(norm_cls(D, eps=c.rms_norm_eps) for _ in range(n))
        t = load_file(str(path / "model.safetensors"))
        self.d2t = t.pop("d2t")
        t.pop("t2d"), t.pop("embed_tokens.weight")
        self.load_state_dict(t)

    def fuse(self, aux):
        if self.cfg.get("norm_before_fc"):
            aux = self.input_norm(aux)
        if self.cfg.get("fc_norm"):
            aux = torch.cat([m(x) for m, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, tokens, hidden, positions):
        """→ (the next row's hidden, logits over the draft vocabulary), causal over the rows."""
        layer = self.layers[0]
        embeds, h = layer.input_layernorm(self.embed[tokens]), layer.hidden_norm(hidden)
        # a config without the field: true, as vLLM reads it (speculators itself always writes it)
        residual = h if self.cfg.get("norm_before_residual", True) else hidden
        x = torch.cat([embeds, h], dim=-1)[None]
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=self.rotary(x, positions[None]),
                                  attention_mask=mask)
        out = residual + attn[0]
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        normed = self.norm(out)
        return (normed if self.cfg.get("norm_output") else out), self.lm_head(normed)


def _rows(seed: int, T: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (T,), generator=g), torch.randn(T, n * 64, generator=g) * 3, torch.arange(T) + 5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_head_equals_speculators_model(base, tmp_path, variant):
    """The head read from the speculators format computes what speculators' model computes: two
    rounds, the second chained on the first's hidden (as a draft is), logits and draft ids."""
    path = _write(tmp_path / variant, base, variant)
    embed = base.model.embed_tokens.weight.detach()
    ref = SpeculatorsReference(path, embed)
    head = load_eagle3(path, base.args).bind_embedding(base.model.embed_tokens)
    a = head.args
    assert (a.norm_before_residual, a.norm_before_fc, a.fc_norm, a.norm_output) == tuple(
        bool(ref.cfg.get(f, f == "norm_before_residual")) for f in
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    tokens, aux, pos = _rows(1, 7, len(VARIANTS[variant][2]))
    with torch.no_grad():
        want_h, want_logits = ref(tokens, ref.fuse(aux), pos)
        got_h = head(tokens, head.fuse(aux), pos, causal_attend)
        torch.testing.assert_close(got_h, want_h, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(head.logits(got_h), want_logits, atol=5e-5, rtol=2e-5)
        nxt = want_logits.argmax(-1)
        want2, logits2 = ref(nxt, want_h, pos + 1)
        got2 = head(nxt, got_h, pos + 1, causal_attend)
        torch.testing.assert_close(head.logits(got2), logits2, atol=5e-5, rtol=2e-5)
    ids = head.logits(got2).argmax(-1)
    assert torch.equal(head.target_ids(ids), ids + ref.d2t[ids])


@pytest.mark.parametrize("variant", ["llama-default", "qwen3-fc-norm-out", "llama-two-aux-fc-norm"])
def test_drafting_with_a_speculators_head_keeps_greedy_plain(base, tmp_path, variant):
    path = _write(tmp_path / variant, base, variant)
    prompts = _prompts([9, 17], seed=4)
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = EagleProposer(load_eagle3_for_inference(path, base), tree=TreeSpec(2, 2))
    seqs = _run(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == plain and sum(s.stats.drafted for s in seqs) > 0


@pytest.mark.parametrize("variant, sglang", [("llama-default", "refused"), ("llama-plain", "loads"),
                                             ("qwen3-fc-norm-out", "refused")])
def test_quantized_into_the_plain_layout_with_its_flags(base, tmp_path, variant, sglang):
    """`quantize` writes a speculators head in the plain layout (`midlayer.` names, vLLM's
    architecture for its layer, the variants' flags), which quantspec runs to the float head's
    drafts; inspect gives the engines' verdicts: vLLM loads every variant, SGLang only the plain
    Llama layer."""
    from safetensors import safe_open

    from quantspec import api

    path = _write(tmp_path / variant, base, variant)
    assert api.inspect(path)["engines"]["sglang"]["status"] == "refused"  # no speculators config in SGLang
    out = api.quantize(str(path), "weight_only_int8", tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    kind, fields, aux = VARIANTS[variant]
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}[kind]]
    assert {f: cfg.get(f, False) for f in fields} == {f: v for f, v in fields.items()}
    assert cfg.get("norm_before_residual", False) == fields.get("norm_before_residual", True)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(aux)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "midlayer.mlp.down_proj.weight_packed" in names and not any(k.startswith("layers.") for k in names)
    engines = api.inspect(out)["engines"]
    assert (engines["vllm"]["status"], engines["sglang"]["status"]) == ("loads", sglang)
    float_head = load_eagle3_for_inference(path, base)
    q = load_eagle3_for_inference(out, base)
    tokens, feats, pos = _rows(2, 6, len(aux))
    with torch.no_grad():
        want = float_head.logits(float_head(tokens, float_head.fuse(feats), pos, causal_attend))
        got = q.logits(q(tokens, q.fuse(feats), pos, causal_attend))
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_quantize_target_sglang_refuses_a_head_sglang_runs_otherwise(base, tmp_path):
    from quantspec import api

    path = _write(tmp_path / "h", base, "llama-default")
    with pytest.raises(QuantSpecError, match="--target sglang: .*norm_before_residual.*pass --target vllm"):
        api.quantize(str(path), "weight_only_int8", tmp_path / "q", target="sglang")
    assert not (tmp_path / "q").exists()


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize("change, message", [
    ({"speculators_model_type": "dflash"}, "a speculators 'dflash' model; quantspec reads speculators' EAGLE-3"),
    ({"norm_before_fc": True, "fc_norm": True}, "norm_before_fc and fc_norm are both set"),
    ({"transformer_layer_config": {"model_type": "mistral"}}, "model_type 'mistral'; speculators EAGLE-3 heads of"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "a quantized speculators-format head"),
])
def test_speculators_configs_quantspec_does_not_read_are_refused_in_one_line(base, tmp_path, change, message):
    path = _write(tmp_path / "h", base, "llama-plain")
    _edit(path, **change)
    with pytest.raises(QuantSpecError, match=message):
        load_eagle3_for_inference(path, base)


def test_a_head_with_another_embedding_is_refused(base, tmp_path):
    other = torch.randn(512, 64)
    path = _write(tmp_path / "h", base, "llama-plain", embed=other)
    with pytest.raises(QuantSpecError, match="embed_tokens differs from the base's embedding"):
        load_eagle3_for_inference(path, base)


@pytest.mark.parametrize("embed_type", ["weight_only_int8", "weight_only_int4"])
def test_a_head_s_own_embedding_is_checked_against_a_quantized_base_s(base, tiny_llama_dir, tmp_path, embed_type):
    """A base whose embedding is quantized (`QuantEmbedding`): a head carrying a copy of the float
    embedding the base was quantized from binds to it (it rounds to the base's codes, though the mse
    observer clips some of them further than half a step), and a head carrying another embedding is
    still refused."""
    from quantspec import api
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.quant_embedding import QuantEmbedding

    art = api.quantize(str(tiny_llama_dir), "weight_only_int8", tmp_path / "base", target="quantspec",
                       layer_quant_types=(f"model.embed_tokens={embed_type}",))
    qbase = load_for_inference(art, tokenizer=False).model
    assert isinstance(qbase.model.embed_tokens, QuantEmbedding)
    gap = (qbase.model.embed_tokens.dequantized() - base.model.embed_tokens.weight.detach()).abs().max()
    assert gap > 1e-3  # the quantized rows are not the float ones: the check must allow the steps
    head = load_eagle3_for_inference(_write(tmp_path / "own", base, "llama-plain"), qbase)
    assert head.own_embed is None and head._embed[0] is qbase.model.embed_tokens
    other = base.model.embed_tokens.weight.detach() + 0.5 * torch.randn(base.model.embed_tokens.weight.shape)
    with pytest.raises(QuantSpecError, match="embed_tokens differs from the base's embedding"):
        load_eagle3_for_inference(_write(tmp_path / "other", base, "llama-plain", embed=other), qbase)


def _as_model(path, verifier, tokens=3):
    """The head's speculators_config names `verifier` and `tokens` drafts per step."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = tokens
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_speculators_head_as_the_model_speculates_for_its_verifier(base, tiny_llama_dir, tmp_path):
    """vLLM's `vllm serve SPECULATOR`: the head given as --model runs its verifier speculating
    with it, its speculative_tokens drafts per step, to plain greedy's tokens."""
    from test_spec_cli import ROWS, _infer

    head = _as_model(_write(tmp_path / "h", base, "llama-default"), tiny_llama_dir)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"src": s}) + "\n" for s in ROWS))
    plain, _ = _infer(tmp_path, tiny_llama_dir, data)
    spec, stats = _infer(tmp_path, head, data, tag="speculator")
    assert spec == plain
    assert stats["speculate_method"] == "eagle" and stats["drafted_tokens"] > 0
    assert len(stats["acceptance_per_position"]) <= 3
    _, stats = _infer(tmp_path, head, data, "--speculate-max-draft-token-num", 1, tag="one")
    assert len(stats["acceptance_per_position"]) == 1  # the flag overrides the head's own


@pytest.mark.parametrize("extra, needle", [
    (["--speculate-method", "inference_with_reference"], "names its own speculation"),
    (["--speculative-config", '{"method": "ngram"}'], "names its own speculation"),
])
def test_a_speculators_head_as_the_model_refuses_other_speculation(base, tiny_llama_dir, tmp_path, extra, needle):
    from click.testing import CliRunner

    from quantspec.cli import main

    head = _as_model(_write(tmp_path / "h", base, "llama-plain"), tiny_llama_dir)
    r = CliRunner().invoke(main, ["infer", "--model", str(head), "--prompt", "hi", *extra])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


def test_serve_takes_a_speculators_head_as_its_model(base, tiny_llama_dir, tmp_path, monkeypatch):
    """`quantspec serve SPECULATOR` (vLLM's `vllm serve SPECULATOR`) serves the verifier with the
    head drafting: the server's config, as serve builds it."""
    from click.testing import CliRunner

    from quantspec import api
    from quantspec.cli import main

    head = _as_model(_write(tmp_path / "h", base, "llama-plain"), tiny_llama_dir, tokens=4)
    seen = []
    monkeypatch.setattr(api, "serve", lambda config, **kw: seen.append(config))
    r = CliRunner().invoke(main, ["serve", str(head)])
    assert r.exit_code == 0, r.output
    (config,) = seen
    assert (config.model, config.speculate_method, config.draft_model, config.speculate_max_draft_token_num) == \
        (str(tiny_llama_dir), "eagle", str(head), 4)
