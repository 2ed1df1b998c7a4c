"""Tiny deterministic random HF checkpoints (and their tokenizer) for tests, fully offline.

This file owns:
- `TINY_CORPUS`: a few KB of fixed English and code-like text, the tokenizer's training data and a
  handy calibration/eval text for tests.
- `build_tiny_tokenizer`: a byte-level BPE trained with `tokenizers` on that corpus, with ChatML
  special tokens and a SmolLM2-like chat template. Same arguments -> identical vocab every run;
  `variant=1` trains on a transformed corpus and yields a *different* vocab (for "draft tokenizer
  differs from base" tests).
- `build_tiny_model`: a Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Mistral / Mixtral / Phi-3 / SmolLM3 /
  Granite / OLMo 2 / Gemma 2 / Gemma 3 checkpoint (transformers' own classes) with a fixed seed, written with `save_pretrained`
  as safetensors (optionally sharded), plus the tokenizer and a generation config whose eos is
  `<|im_end|>`.

Weight scaling (why the init is not transformers' default): with std-0.02 init the final hidden
state barely depends on the input and the logits are near uniform (spread ~0.1 nat), so greedy
decoding is decided by rounding noise and any quantization flips it. Instead:
- embeddings are N(0, 1) (residual stream at unit scale); with tied embeddings they are
  N(0, 0.02^2) instead: the residual is then dominated by the blocks' outputs, otherwise it
  stays aligned with the input token's own row and greedy decoding just repeats the last token,
- every Linear weight is N(0, 1/fan_in) (each projection roughly preserves scale, so the
  attention and MLP blocks matter as much as the embedding),
- Qwen2's q/k/v biases are N(0, 0.1^2) (non-zero so that bias handling is exercised), and
  Qwen3's per-head q / k norm gains U(0.5, 1.5) (not ones, so that they are exercised),
- the final RMSNorm gain is set to the constant that makes the std of the logits over the vocab,
  measured on a fixed probe sequence, equal `LOGIT_STD` (3 nats): peaked but not one-hot.
Padding rows (`vocab_pad_to`) of the embedding and the untied lm_head are zero, so their logit is
exactly 0, well below the typical max logit (~3 sigma of 512 draws) and never chosen greedily.
The untied lm_head rows of the special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) are
zero too, so greedy generation from an untied tiny model does not stop early at eos (tests that
need an eos stop pass an eos id they observed in the output). Tied models cannot do this (the
rows are also input embeddings) and may emit them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from quantspec.errors import QuantSpecError

__all__ = [
    "TINY_CORPUS",
    "SPECIAL_TOKENS",
    "UNK_PAD_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "CHATML_TEMPLATE",
    "LOGIT_STD",
    "TINY_ARCHS",
    "build_tiny_tokenizer",
    "build_tiny_model",
]

# Special tokens, in id order 0, 1, 2 (same roles as SmolLM2's).
UNK_PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (UNK_PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# ChatML, as in SmolLM2-Instruct (with a shorter default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Target std (nats) of the logits over the vocab at a position; see module docstring.
LOGIT_STD = 3.0
# Std of tied embeddings (see module docstring).
TIED_EMBED_STD = 0.02
# Std of Qwen2's q/k/v biases.
QKV_BIAS_STD = 0.1
# Granite's multipliers in a tiny model: each far enough from 1 that leaving one out shows
GRANITE_MULTIPLIERS = {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.05,
                       "logits_scaling": 2.0}
# Gemma in a tiny model: every other layer slides a window shorter than the tests' prompts and
# scores are scaled by 1 / √(2 head_dim); Gemma 3's window layers turn by a rotary base of their
# own; Gemma 2's caps are low enough to bend the tiny model's scores and logits
GEMMA_LAYOUT = {"sliding_window": 6}
GEMMA3_LOCAL_THETA = 100.0
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 4.0}
# Shard size for `sharded=True`: small enough that the tiny default model gets several shards.
TINY_MAX_SHARD_SIZE = "100KB"

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "smollm3", "granite",
              "olmo2", "gemma2", "gemma3")
# a tiny MoE's experts unless `build_tiny_model(moe=...)` says otherwise (HF config keys;
# moe_intermediate_size, and Qwen2-MoE's shared expert's, default to half the dense intermediate;
# Mixtral's experts take the dense intermediate);
# Qwen3-MoE renormalizes the top-k weights as its published configs do, Qwen2-MoE does not
TINY_MOE = {"qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
            "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
            "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}
# the routers' weights are N(0, ROUTER_GAIN^2 / fan_in): spread logits keep the top-k
# choice away from ties, so rounding noise rarely flips which experts a token takes
ROUTER_GAIN = 3.0

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a great deal from a
few pages of text, as long as the text is varied and the examples are clear.

Once upon a time, in a quiet village by the sea, there lived an old fisherman and his daughter.
Every morning they walked down to the harbour, checked the nets, and talked about the weather.
The daughter wanted to become a sailor and see the world beyond the horizon. Her father told her
stories about storms, islands, lighthouses and the stars that guide ships home at night.

Quantization maps real numbers to a small set of integers. A scale and a zero point describe the
mapping: q = round(x / scale) + zero_point, and x is recovered as (q - zero_point) * scale.
Eight-bit integers keep most of the accuracy of a model, while four-bit weights need care: the
weights are split into groups, and each group gets its own scale. Calibration runs the model on a
sample of real text to measure the range of every activation before the scales are chosen.

Speculative decoding makes generation faster without changing its result. A cheap drafter
proposes a few tokens, the large model checks all of them in one forward pass, and every token
that matches is accepted. When a draft token is rejected, the large model's own token is used
instead, so the output is exactly what the large model would have written alone.

Questions and answers:
Q: What is the capital of France? A: Paris is the capital of France.
Q: How many days are there in a week? A: There are seven days in a week.
Q: What colour is the sky on a clear day? A: The sky is blue on a clear day.
Q: Why do leaves fall in autumn? A: Trees drop their leaves to save water during the winter.

def quantize(x, scale, zero_point=0, qmin=-128, qmax=127):
    \"\"\"Round x to the integer grid given by scale and clamp to [qmin, qmax].\"\"\"
    q = torch.round(x / scale) + zero_point
    return torch.clamp(q, qmin, qmax).to(torch.int8)


def dequantize(q, scale, zero_point=0):
    return (q.float() - zero_point) * scale


class Counter:
    def __init__(self):
        self.count = 0

    def update(self, values):
        for value in values:
            if value is not None and value > 0:
                self.count += 1
        return self.count


for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")

{"name": "tiny", "layers": 2, "hidden_size": 64, "heads": [4, 2], "ok": true}

SELECT name, price FROM products WHERE price > 10 ORDER BY price DESC LIMIT 5;

The weather today is sunny with a light breeze from the west. Tomorrow there will be clouds in
the morning and rain in the afternoon, with temperatures between twelve and eighteen degrees.
Remember to bring an umbrella, a warm coat and a good book for the train.

In the library there were thousands of books: history, science, poetry, mathematics, cooking and
travel. Children read picture books on the carpet while students wrote essays at long wooden
tables. The librarian knew where every book belonged and could find any title in a minute.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 4096 3.14159 2.71828 -1 -0.5 1e-5.
Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? , . ; : ' " # @ $ _ \\ `
"""


def _variant_corpus(variant: int) -> str:
    """The training text for tokenizer `variant`: 0 is `TINY_CORPUS`; 1 reverses every word,
    which changes the frequent byte pairs and therefore the learned merges and vocab."""
    if variant == 0:
        return TINY_CORPUS
    if variant == 1:
        return "\n".join(" ".join(w[::-1] for w in line.split(" ")) for line in TINY_CORPUS.splitlines())
    raise QuantSpecError(f"tokenizer variant={variant} is unknown; use 0 or 1")


def build_tiny_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 512, variant: int = 0):
    """Train a deterministic byte-level BPE on the built-in corpus and wrap it for transformers.

    Ids 0, 1, 2 are `<|endoftext|>` (unk/pad), `<|im_start|>` (bos), `<|im_end|>` (eos). The
    result has exactly `vocab_size` entries (the corpus has enough pairs for up to ~1000).
    If `out_dir` is given, the tokenizer is also saved there with `save_pretrained`.
    Returns a `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_base = 256 + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < n_base:
        raise QuantSpecError(
            f"vocab_size={vocab_size!r} is too small for a byte-level BPE; use an int >= {n_base}"
        )
    corpus = _variant_corpus(variant)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per "document": training is deterministic for a fixed ordered input.
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise QuantSpecError(
            f"the built-in corpus only yields {tok.get_vocab_size()} tokens, fewer than "
            f"vocab_size={vocab_size}; use a smaller vocab_size"
        )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK_PAD_TOKEN,
        pad_token=UNK_PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def _make_config(arch: str, head_dim: int | None = None, moe: dict | None = None, **kw):
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "phi3": Phi3Config,
               "smollm3": SmolLM3Config, "granite": GraniteConfig, "olmo2": Olmo2Config, "gemma2": Gemma2Config,
               "gemma3": Gemma3TextConfig}
    if arch not in classes:
        raise QuantSpecError(f"arch={arch!r} is not a tiny architecture; use one of {list(classes)}")
    if head_dim is not None or arch.startswith(("qwen3", "gemma")):  # their configs have a head_dim of their own
        kw["head_dim"] = head_dim or kw["hidden_size"] // kw["num_attention_heads"]
    if arch in TINY_MOE:  # Mixtral's experts are `intermediate_size` wide
        half = kw["intermediate_size"] // 2
        widths = {"moe_intermediate_size": half, "shared_expert_intermediate_size": half} \
            if arch == "qwen2_moe" else {} if arch == "mixtral" else {"moe_intermediate_size": half}
        kw.update({**widths, **TINY_MOE[arch], **(moe or {})})
    if arch == "phi3":  # LongRoPE's original context; Phi-3's configs set it beside max_position_embeddings
        kw.setdefault("original_max_position_embeddings",
                      kw["rope_parameters"].get("original_max_position_embeddings", kw["max_position_embeddings"]))
    if arch == "smollm3":  # every other layer without a rotary embedding (published: every fourth)
        kw.setdefault("no_rope_layer_interval", 2)
    if arch == "granite":  # multipliers of Granite 3's kind (its 8B: 12, 0.22, 1/128, 16), none of them 1
        for k, v in GRANITE_MULTIPLIERS.items():
            kw.setdefault(k, v)
    if arch.startswith("gemma"):
        kw.update(GEMMA_LAYOUT, query_pre_attn_scalar=2 * (head_dim or kw["hidden_size"] // kw["num_attention_heads"]),
                  layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention"
                               for i in range(kw["num_hidden_layers"])])
    if arch == "gemma2":
        kw.update(GEMMA2_SOFTCAPS)
    if arch == "gemma3":
        kw.update(rope_parameters={"full_attention": kw["rope_parameters"],
                                   "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA}})
    return classes[arch](**kw)


@torch.no_grad()
def _init_weights(model, vocab_real: int, tie: bool, probe_ids: torch.Tensor) -> None:
    """Re-initialise `model` in place as described in the module docstring (uses the global
    torch RNG, which the caller has seeded)."""
    gemma = model.config.model_type.startswith("gemma")
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_(0.0, TIED_EMBED_STD if tie else 1.0)
            p[vocab_real:].zero_()  # padding rows
        elif name.endswith("lm_head.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            p[vocab_real:].zero_()
            p[: len(SPECIAL_TOKENS)].zero_()  # special tokens are ids 0..2, see build_tiny_tokenizer
        elif name.endswith("mlp.gate.weight"):  # a mixture of experts' router [E, D]
            p.normal_(0.0, ROUTER_GAIN / math.sqrt(p.shape[1]))
        elif p.ndim in (2, 3):  # Linear weight [out, in]; experts' stacked [E, out, in]
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        elif name.endswith(".bias"):
            p.normal_(0.0, QKV_BIAS_STD)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            p.uniform_(0.5, 1.5) if not gemma else p.uniform_(-0.5, 0.5)
        else:  # RMSNorm gains (Gemma's scale by 1 + weight: 2 to 4, so the blocks weigh against the embeddings)
            p.fill_(1.0) if not gemma else p.uniform_(1.0, 3.0)
    if tie:
        model.tie_weights()
    # Calibrate the final norm gain so logits have std LOGIT_STD on the probe sequence.
    logits = model(input_ids=probe_ids[None]).logits[0, :, :vocab_real]  # [T, vocab_real]
    std = logits.float().std(dim=-1).mean().item()
    w = model.model.norm.weight
    w.copy_((w + 1) * (LOGIT_STD / std) - 1) if gemma else w.mul_(LOGIT_STD / std)


def _check_shape(arch: str, *, hidden: int, heads: int, kv_heads: int, vocab_pad_to: int | None,
                 dtype: torch.dtype) -> None:
    """Refuse, naming the argument, a tiny model that cannot be built."""
    if arch not in TINY_ARCHS:
        raise QuantSpecError(f"arch={arch!r} is not a tiny architecture; use one of {list(TINY_ARCHS)}")
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads != 0:
        raise QuantSpecError(f"heads={heads}, kv_heads={kv_heads}: heads must be a positive multiple of kv_heads")
    if hidden % heads != 0:
        raise QuantSpecError(f"hidden={hidden} is not divisible by heads={heads}; pick hidden = heads * head_dim")
    if vocab_pad_to is not None and (not isinstance(vocab_pad_to, int) or vocab_pad_to <= 0):
        raise QuantSpecError(f"vocab_pad_to={vocab_pad_to!r} must be a positive int or None")
    if not dtype.is_floating_point:
        raise QuantSpecError(f"dtype={dtype} is not a floating dtype; use torch.float32/float16/bfloat16")


def _seeded_model(config, tok, vocab_real: int, tie: bool, seed: int):
    """The fp32 HF model of `config`, initialised by `_init_weights` under `seed`; the caller's
    torch RNG state is restored afterwards."""
    from transformers import AutoModelForCausalLM

    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        probe = torch.tensor(tok(TINY_CORPUS[:400])["input_ids"][:64], dtype=torch.long)  # [T]
        _init_weights(model, vocab_real, tie, probe)
    finally:
        torch.random.set_rng_state(rng_state)
    return model


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    head_dim: int | None = None,
    vocab_pad_to: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sharded: bool = False,
    tokenizer_variant: int = 0,
    moe: dict | None = None,
) -> Path:
    """Write a tiny random HF checkpoint of `arch` to `out_dir` and return that path.

    The directory holds config.json, safetensors weights (`model.safetensors`, or shards plus
    `model.safetensors.index.json` when `sharded`), generation_config.json (eos `<|im_end|>`)
    and the tiny tokenizer (`tokenizer_variant`). `vocab_pad_to` rounds the model's vocab up to
    a multiple (extra rows have no token). `head_dim`: the attention heads' size where it is not
    hidden / heads (as Qwen3's configs set it). `rope_scaling` is a HF rope dict, e.g.
    {"rope_type": "linear", "factor": 2.0}. `moe`: a qwen2_moe / qwen3_moe model's expert settings
    in HF config keys over `TINY_MOE` (e.g. {"mlp_only_layers": [1]}). Same arguments -> bit-identical
    weights.
    """
    from transformers import GenerationConfig

    _check_shape(arch, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab_pad_to=vocab_pad_to, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(out, variant=tokenizer_variant)
    vocab_real = len(tok)
    vocab = vocab_real if vocab_pad_to is None else -(-vocab_real // vocab_pad_to) * vocab_pad_to
    bos, eos, pad = (tok.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN, UNK_PAD_TOKEN))

    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    config = _make_config(arch, head_dim, moe, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                          rope_parameters=rope, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-6)

    model = _seeded_model(config, tok, vocab_real, tie_word_embeddings, seed).to(dtype)
    save_kw = {"max_shard_size": TINY_MAX_SHARD_SIZE} if sharded else {"max_shard_size": "10GB"}
    model.save_pretrained(str(out), safe_serialization=True, **save_kw)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(str(out))
    return out
