"""The draft-model proposer (`speculate_method = draft`): a smaller (or quantized) model with the
base's tokenizer drafts k tokens per sequence autoregressively, from its own paged KV cache.

This file owns:
- `check_draft_compatible`: the draft's tokenizer must be the base's (same vocab, same special
  tokens, same encoding of a probe text); model vocabularies may differ only by padding rows
  (embedding rows beyond the tokenizer's size), which are sliced off.
- `DraftModelProposer`: the drafter and its KV bookkeeping.
- `build_draft_proposer(config, loaded)`: loads `--draft-model` with `load_for_inference` (so any
  quant type works), checks it, and builds the proposer with the back-off policy, whose draft
  cost is measured once (`measure_step_cost`).

KV bookkeeping. For each sequence the drafter remembers how many leading positions of
`seq.tokens` its cache holds (`num_cached`) and which draft tokens it fed after them. A step:
1. sync: the drafts fed last step that the verifier accepted (the common prefix of those drafts
   and the tokens that now follow) stay valid; the rest is rolled back by bookkeeping alone
   (the next write overwrites the slots).
2. catch-up: one batched forward over every drafting sequence's uncached tokens (the whole
   prompt the first time; otherwise the bonus/recovered token and, after a fully accepted step,
   the last draft) → logits for draft 1.
3. k_max - 1 autoregressive forwards, each feeding draft j of the sequences that want more than
   j drafts (k differs per sequence; sequences whose k is 0 skip the drafter entirely).

Drafts. A greedy request gets the draft's argmax (deterministic drafts: probs None). A sampling
request gets drafts sampled from q = logits_to_probs(draft logits, the request's temperature /
top-k / top-p / min-p), returned with q as [k, V_base] rows (zero on padding ids), so `verify` accepts
with min(1, p/q) and resamples from max(0, p - q): the output stays distributed exactly as the
base alone. Draws come from a per-sequence generator derived from the request's generator, so
seeded runs are reproducible and batch-invariant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.backend import Runtime, default_runtime
from quantspec.infer.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache
from quantspec.infer.sampler import logits_to_probs, sample, sampling_tensors
from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost, loaded_runtime
from quantspec.infer.spec.types import SpecProposal
from quantspec.model_zoo.llama import Transformer

__all__ = ["DraftModelProposer", "check_draft_compatible", "common_vocab_size", "build_draft_proposer",
           "int8_draft_head", "measure_step_cost"]

# Salt of the draft-sampling stream, so it is independent of the request's own stream.
_DRAFT_STREAM = 0x5EC_D4AF7
# A text whose encoding must agree between the two tokenizers (merges, normalisation, bytes).
_PROBE_TEXT = "Speculative decoding: def f(x):\n    return x ** 2  # héllo, 世界! 12345 <|im_end|>"


def _special_tokens(tok) -> dict[str, str | None]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    out = {n: getattr(tok, n, None) for n in names}
    out["all"] = ",".join(sorted(getattr(tok, "all_special_tokens", []) or []))
    return out


def check_draft_compatible(base_tok, draft_tok, base_name: str, draft_name: str) -> None:
    """Refuse a draft whose tokenizer is not the base's (one-line `QuantSpecError` naming both)."""
    fix = "use a draft model trained with the base's tokenizer"
    base_vocab, draft_vocab = base_tok.get_vocab(), draft_tok.get_vocab()
    if base_vocab != draft_vocab:
        diff = sorted(set(base_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        example = f"e.g. {diff[0][0]!r} -> {diff[0][1]}" if diff else ""
        raise QuantSpecError(
            f"draft model {draft_name} has a different tokenizer from base model {base_name} "
            f"(vocab {len(draft_vocab)} vs {len(base_vocab)} tokens, {len(diff)} entries differ, {example}); {fix}"
        )
    sb, sd = _special_tokens(base_tok), _special_tokens(draft_tok)
    if sb != sd:
        key = next(k for k in sb if sb[k] != sd[k])
        raise QuantSpecError(
            f"draft model {draft_name} and base model {base_name} have different special tokens "
            f"({key}: {sd[key]!r} vs {sb[key]!r}); {fix}"
        )
    eb = base_tok(_PROBE_TEXT, add_special_tokens=False).input_ids
    ed = draft_tok(_PROBE_TEXT, add_special_tokens=False).input_ids
    if eb != ed:
        raise QuantSpecError(
            f"draft model {draft_name} encodes text differently from base model {base_name} "
            f"(same vocab, different merges or normalisation); {fix}"
        )


def common_vocab_size(tokenizer, base_vocab: int, draft_vocab: int, base_name: str, draft_name: str) -> int:
    """The ids both models can score: the tokenizer's size. Rows beyond it in either model are
    padding (accepted); a model with fewer rows than the tokenizer is refused."""
    n = len(tokenizer)
    for name, v in ((base_name, base_vocab), (draft_name, draft_vocab)):
        if v < n:
            raise QuantSpecError(
                f"model {name} has {v} vocabulary rows but its tokenizer has {n} tokens; "
                "the checkpoint does not match its tokenizer"
            )
    return n


@dataclass
class _DraftSeq:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading positions of seq.tokens whose K/V the draft cache holds
    fed_from: int = 0  # position of the first draft token fed last step
    fed: list[int] = field(default_factory=list)  # draft tokens fed last step (tentative KV)
    generator: torch.Generator | None = None


class DraftModelProposer:
    """Drafts with a model of its own (any quant type) and its own paged KV cache.

    model:             the draft `Transformer` (vocab may have padding rows beyond `vocab_size`).
    vocab_size:        the ids drafts may take (the shared tokenizer's size); logits beyond are cut.
    target_vocab_size: the width of the base's logits (the width of the returned q rows).
    max_draft_tokens:  K; max_batch_size, max_length, block_size size the draft cache like the base's.
    policy:            an `AdaptiveDraftLength` choosing k per sequence, or None for always K.
    head:              what scores the drafts over the draft's final norm (`int8_draft_head`, at
                       least `vocab_size` outputs), or None for the draft's own head.
    runtime:           what the draft's backend prepared (`LoadedModel.runtime`); None: its modules.
    """

    needs_hidden = False

    def __init__(self, model: Transformer, *, vocab_size: int, target_vocab_size: int, max_draft_tokens: int,
                 max_batch_size: int, max_length: int, block_size: int = 64,
                 policy: AdaptiveDraftLength | None = None, head: torch.nn.Module | None = None,
                 runtime: Runtime | None = None):
        args = model.args
        if not 1 <= vocab_size <= min(args.vocab_size, target_vocab_size):
            raise QuantSpecError(
                f"vocab_size={vocab_size} must be in [1, min(draft vocab {args.vocab_size}, "
                f"base vocab {target_vocab_size})]"
            )
        if head is not None and getattr(head, "out_features", vocab_size) < vocab_size:
            raise QuantSpecError(f"the draft head scores {head.out_features} ids, fewer than vocab_size={vocab_size}")
        self.model, self.vocab_size, self.target_vocab_size = model, vocab_size, target_vocab_size
        self.head = head
        self.max_draft_tokens, self.policy, self.block_size = max_draft_tokens, policy, block_size
        self.device = model.model.norm.weight.device
        self.runtime = runtime or default_runtime(self.device)
        per_seq = -(-(max_length + max_draft_tokens + 1) // block_size)
        self.cache = PagedKVCache.of(args, num_blocks=max_batch_size * per_seq + 1, block_size=block_size,
                                     dtype=model.model.norm.weight.dtype, device=self.device,
                                     kernel=self.runtime.attention)
        self._seqs: dict[int, _DraftSeq] = {}
        self.num_forwards = 0  # draft forwards run (for benchmarks)

    # -- state -----------------------------------------------------------------------------------

    def _state(self, seq) -> _DraftSeq:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = _DraftSeq(generator=self._draft_generator(seq.generator))
        return st

    def _draft_generator(self, g: torch.Generator | None) -> torch.Generator | None:
        if g is None:
            return None
        state = np.random.SeedSequence([g.initial_seed(), _DRAFT_STREAM]).generate_state(1, np.uint64)
        out = torch.Generator(device=self.device)
        out.manual_seed(int(state[0]) % 2**63)
        return out

    @staticmethod
    def _sync(st: _DraftSeq, tokens: list[int]) -> None:
        """Keep the KV of last step's fed drafts that the verifier accepted; drop the rest."""
        if st.fed and st.num_cached == st.fed_from:
            n = 0
            for d, t in zip(st.fed, tokens[st.fed_from:]):
                if d != t:
                    break
                n += 1
            st.num_cached += n
        st.fed = []

    def release(self, seq) -> None:
        st = self._seqs.pop(seq.seq_id, None)
        if st is not None:
            self.cache.allocator.free(st.block_table)
        if self.policy is not None:
            self.policy.forget(seq)

    # -- drafting --------------------------------------------------------------------------------

    def _forward(self, states: list[_DraftSeq], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed `feeds[i]` at positions starts[i].. for each sequence → logits of each sequence's
        last fed position [A, vocab_size] fp32."""
        q_lens = [len(f) for f in feeds]
        seq_lens = [s + q for s, q in zip(starts, q_lens)]
        for st, sl in zip(states, seq_lens):
            need = -(-sl // self.block_size) - len(st.block_table)
            if need > 0:
                after = st.block_table[-1] if st.block_table else None
                st.block_table.extend(self.cache.allocator.allocate(need, after=after))
        meta = self.cache.metadata(q_lens, seq_lens, [st.block_table for st in states], self.device)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)  # [T]
        positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)]).to(self.device)  # [T]
        last = torch.tensor(np.cumsum(q_lens) - 1, device=self.device)  # [A]
        out_rows = last if len(q_lens) < ids.shape[0] else None  # every row is a last one: all of them
        hidden = self.model(ids, positions, PagedAttention(self.cache, meta), out_rows,
                            stack=self.runtime.stack)  # [A, D]
        self.num_forwards += 1
        return _draft_logits(self.model, self.head, hidden)[:, : self.vocab_size]  # [A, vocab]

    def _choose(self, logits: torch.Tensor, seqs: list, states: list[_DraftSeq]):
        """One draft token per row of `logits` [A, vocab] → (ids [A] list, q [A, V_base] or None
        per row)."""
        tokens = logits.argmax(dim=-1)  # [A]
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if rows:
            q = logits_to_probs(logits[rows],
                                *sampling_tensors([seqs[i].params for i in rows], self.device))  # [S, vocab]
            drawn = sample(q, [states[i].generator for i in rows])  # [S]
            if self.target_vocab_size > self.vocab_size:  # padding ids: never drafted, q = 0
                q = torch.nn.functional.pad(q, (0, self.target_vocab_size - self.vocab_size))  # [S, V_base]
            for j, i in enumerate(rows):
                tokens[i] = drawn[j]
                probs[i] = q[j]
        return tokens.tolist(), probs

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int]) -> SpecProposal:
        """The drafts of each sequence, with q [k_b, V_base] for a sampling sequence (else None)."""
        ks = [(self.policy.num_drafts(s, b) if self.policy is not None else min(self.max_draft_tokens, b))
              for s, b in zip(seqs, budgets)]
        drafts: list[list[int]] = [[] for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        if active:
            states = [self._state(seqs[i]) for i in active]
            feeds, starts = [], []
            for i, st in zip(active, states):
                tokens = seqs[i].tokens
                self._sync(st, tokens)
                feeds.append(tokens[st.num_cached:])
                starts.append(st.num_cached)
                st.num_cached = len(tokens)
                st.fed_from = len(tokens)
            logits = self._forward(states, feeds, starts)  # [A, vocab]
            for j in range(max(ks[i] for i in active)):
                toks, probs = self._choose(logits, [seqs[i] for i in active], states)
                for a, i in enumerate(active):
                    drafts[i].append(toks[a])
                    if probs[a] is not None:
                        q_rows[i].append(probs[a])
                # sequences that want draft j + 2 feed draft j + 1 (its K/V is tentative)
                keep = [a for a, i in enumerate(active) if ks[i] > j + 1]
                if not keep:
                    break
                active = [active[a] for a in keep]
                states = [states[a] for a in keep]
                for a, st in zip(keep, states):
                    st.fed.append(toks[a])
                logits = self._forward(states, [[drafts[i][-1]] for i in active],
                                       [st.fed_from + len(st.fed) - 1 for st in states])
        out_probs = [torch.stack(r) if r else None for r in q_rows]  # [k_b, V_base] or None
        return SpecProposal([torch.tensor(d, dtype=torch.int64) for d in drafts], out_probs)


def build_draft_proposer(config, loaded) -> DraftModelProposer:
    """Load `config.draft_model` (the base's device; its own `auto` dtype; any quant type), check its
    tokenizer and vocabulary against the base, and build the proposer with the back-off policy."""
    from quantspec.infer.loader import auto_dtype, load_for_inference

    base, base_runtime = loaded.model, loaded_runtime(loaded)
    device = base.model.norm.weight.device
    # the draft's own activation dtype: a weight-only int draft runs torch's packed bf16 ops on CPU
    dtype = auto_dtype(config.draft_model, device) if config.dtype == "auto" else base.model.norm.weight.dtype
    draft = load_for_inference(config.draft_model, dtype=dtype, device=device)
    check_draft_compatible(loaded.tokenizer, draft.tokenizer, str(config.model), str(config.draft_model))
    vocab = common_vocab_size(loaded.tokenizer, base.args.vocab_size, draft.model.args.vocab_size,
                              str(config.model), str(config.draft_model))
    k = config.speculate_max_draft_token_num
    int8 = (getattr(config, "speculate_draft_head", None) or "int8") == "int8"
    head = int8_draft_head(draft.model, vocab, draft.runtime) if int8 else None
    step = measure_step_cost(draft.model, base, draft_head=head, draft_runtime=draft.runtime, base_runtime=base_runtime)
    cost = SpecCost.for_device(device, draft_per_token=step, packed_cpu=base_runtime.packed_rows)
    return DraftModelProposer(
        draft.model, vocab_size=vocab, target_vocab_size=base.args.vocab_size, max_draft_tokens=k,
        max_batch_size=config.batch_size, max_length=config.max_length, block_size=config.block_size,
        policy=AdaptiveDraftLength(k, cost) if getattr(config, "speculate_backoff", True) else None, head=head,
        runtime=draft.runtime,
    )


def int8_draft_head(model: Transformer, vocab_size: int, runtime: Runtime | None = None) -> torch.nn.Module | None:
    """`--speculate-draft-head int8`: the first `vocab_size` rows of the draft model's head rounded
    per row to int8 by its backend (`Runtime.int8_head`; None where the backend has none: the
    draft's own head scores its drafts). Drafts are proposals, so the output does not change."""
    runtime = runtime or default_runtime(model.model.norm.weight.device)
    if runtime.int8_head is None:
        return None
    return runtime.int8_head(model.head_weight()[:vocab_size].float())


def _draft_logits(model: Transformer, head: torch.nn.Module | None, hidden: torch.Tensor,
                  row_invariant: bool = False) -> torch.Tensor:
    """Draft logits [N, V'] fp32 for pre-norm hidden states [N, D]: the model's own head, or
    `head` (an `int8_draft_head`, V' = the common vocabulary) over the same final norm."""
    if head is None:
        return model.compute_logits(hidden, row_invariant)
    return head(model.model.norm(hidden)).float()


def _decode_step_timer(model: Transformer, runtime: Runtime, head: torch.nn.Module | None = None):
    """A timer of one-token decode steps at position 1 over a one-block paged cache: the engine's
    path (the runtime's attention kernel and layer stack, row-invariant rows), scored by `head`
    (None: the model's own)."""
    a, w = model.args, model.model.norm.weight
    cache = PagedKVCache(num_layers=a.num_layers, num_blocks=2, block_size=16, num_kv_heads=a.num_kv_heads,
                         head_dim=a.head_dim, dtype=w.dtype, device=w.device, kernel=runtime.attention)
    table = cache.allocator.allocate(1)
    ids = torch.ones(1, dtype=torch.int64, device=w.device)
    model(ids, torch.zeros(1, dtype=torch.int64, device=w.device),
          PagedAttention(cache, AttentionMetadata.build([1], [1], [table], 16, w.device, cache.kernel)),
          stack=runtime.stack)
    meta = AttentionMetadata.build([1], [2], [table], 16, w.device, cache.kernel)
    pos = torch.ones(1, dtype=torch.int64, device=w.device)

    def step() -> float:
        t = time.perf_counter()
        hidden = model(ids, pos, PagedAttention(cache, meta), row_invariant=True, stack=runtime.stack)
        _draft_logits(model, head, hidden, row_invariant=True)
        if w.device.type == "cuda":
            torch.cuda.synchronize(w.device)
        return time.perf_counter() - t
    return step


@torch.inference_mode()
def measure_step_cost(draft: Transformer, base: Transformer, *, repeats: int = 5,
                      draft_head: torch.nn.Module | None = None, draft_runtime: Runtime | None = None,
                      base_runtime: Runtime | None = None) -> float:
    """(draft decode step) / (base decode step), measured: one-token forwards + logits of each
    model (the draft's through `draft_head` when it drafts with one: `int8_draft_head`), each on
    its runtime (None: the device's default), interleaved so load on a shared machine hits both
    alike, median of `repeats`, rounded to 0.05 (so the back-off's choices rarely change between
    runs). Measured rather than estimated from weight bytes because the ratio depends on the
    kernels and the machine (the head and a step's small ops stay whatever the weights' bytes)."""
    step_draft = _decode_step_timer(draft, draft_runtime or default_runtime(draft.model.norm.weight.device), draft_head)
    step_base = _decode_step_timer(base, base_runtime or default_runtime(base.model.norm.weight.device))
    step_draft(), step_base()  # warm-up
    ratios = sorted(step_draft() / step_base() for _ in range(repeats))
    return round(ratios[len(ratios) // 2] * 20) / 20
