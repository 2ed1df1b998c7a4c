"""Shared session-scoped fixtures: tiny offline HF checkpoints and the tiny tokenizer.

Each fixture builds once per test session under pytest's `tmp_path_factory` (fast: < 2 s each)
and yields the directory path. Tests must not modify these directories; build a private one with
`quantspec.model_zoo.tiny.build_tiny_model(tmp_path, ...)` when a test needs other options.
"""

from pathlib import Path

import pytest
import torch

from quantspec.model_zoo.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Each test leaves torch's thread count as it found it: the CLI's commands set it for the
    process (`--threads`, quantspec/threads.py), and test modules choose their own."""
    count = torch.get_num_threads()
    yield
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@pytest.fixture(autouse=True)
def _quiet_start_outlasts_a_test(monkeypatch):
    """Plain progress prints nothing during a command's first `QUIET_S` seconds, so a command
    that fails on its input prints only its error line; tests assert that one line, and on a
    loaded machine a command can take longer than that to fail: the quiet start outlasts a test."""
    monkeypatch.setattr("quantspec.console.QUIET_S", 600.0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """2-layer Llama, hidden 64, 4 heads / 2 KV heads, vocab 512, untied, fp32, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory) -> Path:
    """The same Llama with its output head tied to its embedding."""
    return build_tiny_model(tmp_path_factory.mktemp("tied_llama"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """2-layer Qwen2 (q/k/v bias), hidden 64, 4 heads / 2 KV heads, vocab 512, untied, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """2-layer Qwen3 (per-head q / k norms), hidden 64, 4 heads of size 32 (q/k/v wider than the
    hidden size, as in Qwen3's configs) / 2 KV heads, vocab 512, untied, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """2-layer Phi-3 (q/k/v stored as one qkv_proj, gate/up as one gate_up_proj), hidden 64, 4
    heads / 2 KV heads, vocab 512, untied, seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3")


@pytest.fixture(scope="session")
def transformers_model():
    """transformers_model(path) → transformers' own fp32 model of the checkpoint at `path`, in eval mode."""
    from transformers import AutoModelForCausalLM

    return lambda path: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def logits_of(transformers_model):
    """logits_of(model_or_path, ids [T]) → [T, V]: a quantspec `Transformer`'s logits over one
    sequence (plain causal attention), or transformers' own of the checkpoint at a path."""
    from quantspec.model_zoo.llama import DenseCausalAttention

    def run(source, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if isinstance(source, (str, Path)):
                return transformers_model(source)(ids[None]).logits[0]
            T = ids.numel()
            return source.compute_logits(source(ids, torch.arange(T), DenseCausalAttention.of(source.args, 1, T)))

    return run


@pytest.fixture(scope="session")
def artifact_runs_as_in_transformers(logits_of, calibration_table):
    """artifact_runs_as_in_transformers(model_dir, quant_type, out, ids, **options) → the artifact
    `api.quantize` writes (a8w8 types calibrated on the tiny corpus), after asserting that
    quantspec runs it to transformers' logits over `ids` (compressed-tensors' order of operations
    for fp8 activations) and that those differ from the float model's (the check has teeth)."""
    from quantspec import api
    from quantspec.infer.dispatch import DispatchPolicy
    from quantspec.infer.loader import load_for_inference

    def check(model_dir, quant_type: str, out, ids: torch.Tensor, **options) -> Path:
        calib = calibration_table(model_dir) if quant_type.startswith("a8w8") and \
            options.get("activations") != "dynamic" else None
        art = api.quantize(str(model_dir), quant_type, out, calib=calib, **options)
        theirs = logits_of(art, ids)  # transformers runs a float KV cache: so does this forward
        policy = DispatchPolicy(fast=False) if quant_type == "a8w8_fp8" else None
        lm = load_for_inference(art, tokenizer=False, policy=policy)
        torch.testing.assert_close(logits_of(lm.model, ids), theirs, rtol=1e-4, atol=1e-4)
        fp32 = logits_of(load_for_inference(model_dir, tokenizer=False).model, ids)
        assert (fp32 - theirs).abs().max() > 1e-3
        return art

    return check


@pytest.fixture(scope="session")
def engine_decodes_as_generate():
    """engine_decodes_as_generate(model_dir, hf_model): quantspec's engine decodes, one request at a
    time and three joining and leaving one running batch, the 20 tokens transformers' greedy
    `generate` appends to each of three random prompts (asserted)."""
    from quantspec.infer.engine import Engine, EngineConfig
    from quantspec.infer.loader import load_for_inference
    from quantspec.infer.sampler import SamplingParams

    def check(model_dir, hf_model) -> None:
        lm = load_for_inference(model_dir, tokenizer=False)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
        want = [hf_model.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        for batch in (1, 3):
            eng = Engine(lm.model, EngineConfig(block_size=16, max_batch_size=batch, max_length=128),
                         eos_token_ids=[], runtime=lm.runtime)
            seqs = [eng.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
            eng.run()
            assert [s.output_ids for s in seqs] == want

    return check


@pytest.fixture(scope="session")
def calibration_table(tmp_path_factory):
    """calibration_table(model_dir) → a `quantspec calibrate` table of a tiny model on the tiny
    corpus (4 windows of 32 tokens, fp32): made once per model per session; tests only read it."""
    from quantspec import api
    from quantspec.model_zoo.tiny import TINY_CORPUS

    made = {}

    def make(model_dir) -> Path:
        key = str(model_dir)
        if key not in made:
            d = tmp_path_factory.mktemp("calib")
            (d / "calib.txt").write_text(TINY_CORPUS)
            made[key] = api.calibrate(key, str(d / "calib.txt"), d / "table", num_samples=4, seq_len=32,
                                      dtype="float32").path
        return made[key]

    return make


def _ct_scheme_of(qc, name: str):
    """compressed-tensors' precedence for a Linear: an exact name, then a regex target, then the
    class name."""
    import re

    hits = [(0 if t == name else 1 if t.startswith("re:") and re.match(t[3:], name) else 2 if t == "Linear" else None,
             g) for g in qc.config_groups.values() for t in g.targets]
    return min((h for h in hits if h[0] is not None), key=lambda h: h[0])[1]


@pytest.fixture(scope="session")
def ct_scheme_of():
    """ct_scheme_of(qc, name): the scheme of compressed-tensors' `QuantizationConfig` `qc` that
    governs Linear `name`, by compressed-tensors' precedence."""
    return _ct_scheme_of


def _ct_fp4_fp32(comp, local: dict, scheme) -> torch.Tensor:
    """An NVFP4 / MXFP4 weight as compressed-tensors' FP4 compressor decompresses it, its own steps
    (`unpack_fp4_from_uint8`, the compressor's scale, `dequantize`) run in fp32 where its
    `decompress` runs them in bf16."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = local["weight_packed"]
    q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    return dequantize(x_q=q, scale=comp._decompress_scale(local["weight_scale"], torch.float32), args=scheme.weights,
                      global_scale=local.get("weight_global_scale"), dtype=torch.float32).contiguous()


@pytest.fixture(scope="session")
def ct_decompressed():
    """ct_decompressed(art, out) → (out, the decompressed Linears' names): the float checkpoint
    of artifact `art` in directory `out`, each quantized Linear's weight as compressed-tensors' own
    compressor for its scheme's format decompresses it (in fp32: `_ct_fp4_fp32`), every other
    tensor as stored (norms smoothed by a recipe included) but KV-cache scales, config.json
    without its quantization_config."""
    import json

    from safetensors.torch import save_file

    from quantspec.quant.artifact import load_safetensors

    def make(art, out):
        from compressed_tensors.compressors.base import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        cfg = json.loads((art / "config.json").read_text())
        qc = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
        packed = load_safetensors(art)
        names = {k.rsplit(".", 1)[0] for k in packed if k.endswith(".weight_scale")}
        dense = {k: v for k, v in packed.items() if k.rsplit(".", 1)[0] not in names or k.endswith(".bias")}
        dense = {k: v for k, v in dense.items() if not k.endswith((".k_scale", ".v_scale"))}
        for n in names:
            scheme = _ct_scheme_of(qc, n)
            local = {k[len(n) + 1:]: v for k, v in packed.items() if k.startswith(n + ".")
                     and k[len(n) + 1:] not in ("input_scale", "input_zero_point")}
            fmt = scheme.format or qc.format
            comp = BaseCompressor.get_value_from_registry(fmt)
            dense[f"{n}.weight"] = _ct_fp4_fp32(comp, local, scheme) if fmt.endswith("fp4-pack-quantized") \
                else comp.decompress(local, scheme)["weight"].float().contiguous()
        out.mkdir()
        save_file(dense, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(cfg))
        return out, names

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny byte-level BPE tokenizer (variant 0, vocab 512), saved with save_pretrained."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tiny_llama_model(tiny_llama_dir):
    """The tiny Llama loaded as a `model_zoo` Transformer (torch's modules, fp32), one per test
    module; tests must not change its weights."""
    from quantspec.model_zoo.checkpoint import load_model

    return load_model(tiny_llama_dir)[0]


class AnswerOracle:
    """A proposer that drafts the next tokens of known answers (`answers[seq_id]`), so that every
    draft is accepted."""

    needs_hidden = False

    def __init__(self, answers: list[list[int]]):
        self.answers = answers

    def propose(self, seqs, budgets):
        from quantspec.infer.spec.types import SpecProposal

        return SpecProposal.from_token_lists([self.answers[s.seq_id][len(s.output_ids):len(s.output_ids) + b]
                                              for s, b in zip(seqs, budgets)])

    def release(self, seq):
        pass


class CaterpillarOracle:
    """A proposer that drafts caterpillar trees (`spec.tree.caterpillar`): `candidates(seq,
    budget)` gives a sequence's candidate tokens per depth, the first of each depth the parent of
    the next depth's."""

    needs_hidden = False

    def __init__(self, candidates):
        self.candidates = candidates

    def propose(self, seqs, budgets):
        from quantspec.infer.spec.tree import caterpillar
        from quantspec.infer.spec.types import SpecProposal

        ids, parents = [], []
        for s, b in zip(seqs, budgets):
            cands = self.candidates(s, b)
            tokens, par = caterpillar(cands) if cands else ([], [])
            ids.append(torch.tensor(tokens, dtype=torch.int64))
            parents.append(par)
        return SpecProposal(ids, parents=parents)

    def release(self, seq):
        pass


@pytest.fixture(scope="session")
def caterpillar_oracle():
    """`CaterpillarOracle`: caterpillar_oracle(candidates) drafts the trees `candidates(seq, budget)` lists."""
    return CaterpillarOracle


@pytest.fixture(scope="session")
def answer_oracle():
    """`AnswerOracle`: answer_oracle(answers) drafts answers[seq_id]'s next tokens."""
    return AnswerOracle


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    """The tiny Llama's checkpoint loaded by transformers (fp32, eval): the independent reference
    the engine's tokens and log-probabilities are checked against; tests must not change it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_tiny_llama):
    """hf_greedy(prompt ids, n) → the n tokens transformers' greedy `generate` appends (no EOS)."""

    def run(prompt: list[int], n: int) -> list[int]:
        out = hf_tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return run


@pytest.fixture(scope="session")
def hf_logprobs(hf_tiny_llama):
    """hf_logprobs(ids) → [len(ids), V]: transformers' log-probabilities (fp32) of the token after
    each prefix ids[:i + 1], from the tiny Llama's checkpoint."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf_tiny_llama(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def _sequence_law(next_probs, prompt: list[int], depth: int) -> dict[tuple[int, ...], float]:
    """{continuation: exact probability} of every `depth`-token continuation of `prompt`, chaining
    `next_probs(ids)` → [V] probabilities (zero outside the support)."""
    law = {(): 1.0}
    with torch.inference_mode():
        for _ in range(depth):
            grown = {}
            for path, pr in law.items():
                p = next_probs(prompt + list(path))
                for t in p.nonzero().flatten().tolist():
                    grown[path + (t,)] = pr * float(p[t])
            law = grown
    return law


def _pooled_chisquare(counts: dict, exact: dict, n: int) -> float:
    """Chi-square p-value of `counts` (n draws) against the law `exact`, the categories expected
    fewer than 5 times pooled with everything outside `exact`."""
    from scipy.stats import chisquare

    cats = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cats if n * exact[c] >= 5]
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [n * exact[c] for c in big] + [n - sum(n * exact[c] for c in big)]
    return chisquare(obs, exp).pvalue


@pytest.fixture(scope="session")
def sequence_law():
    """sequence_law(next_probs, prompt, depth): the exact law of a sampler's continuations."""
    return _sequence_law


@pytest.fixture(scope="session")
def pooled_chisquare():
    """pooled_chisquare(counts, exact, n): the p-value of sampled counts against an exact law."""
    return _pooled_chisquare
