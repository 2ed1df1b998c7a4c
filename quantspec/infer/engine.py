"""The engine: a batch of requests over one model and one paged KV cache.

Each `step()` runs ONE forward over a flattened batch: either admitted prompts (or a chunk of
each, a prefill step), or every running sequence's last token (decode) or last token plus k
draft tokens (speculative verification); then samples or verifies, appends, and retires finished
sequences so waiting ones are admitted (continuous batching). A step is propose → forward →
accept: the `Proposer` drafts (a `SpecProposal`), the model scores every new row, and the
verifier (`spec/verify.py`) or the sampler picks the tokens.

Row invariance: prefills never share a step with decode rows, and a decode / verification step
asks the forward for row-invariant rows (`row_invariant=True`), so a sequence's rows get the same
numbers whatever else the batch holds and however many drafts it brings: speculation stays
bitwise lossless.

What the device backend prepared (`infer.backend.Runtime`: a one-call layer stack, an exact
greedy picker, the cache's attention kernel) is handed in as `runtime` and plugged in here; a
model the backend did not prepare runs its modules.

Which sequences a step serves (admission, prefix caching, the prefill token budget, chunked
prefill alternating with decode steps, preemption in a cache smaller than the batch) is the
scheduler's (`scheduler.py`); a sequence's state and the rules that end it are `sequence.py`'s.

Serving hooks: `abort(seq)` retires a sequence between steps and frees its KV blocks at once;
`Sequence.speculate = False` gives a sequence no drafts (a request's opt-out); `draft_limit` (a `DraftLimit`, e.g. `spec/load.py`'s)
caps the drafts per sequence of each decode step and is told what the step cost; `last_step`
describes the step that just ran.

Log-probabilities (`SamplingParams.logprobs` / `prompt_logprobs`): `_forward` also keeps the rows
of a prefill chunk that predict prompt tokens, `_record` scores each emitted token at the row that
predicted it (a tree's accepted path), from the raw logits (before penalties and biases).

A sequence's own rules on its logits (min_tokens, penalties, bias, a structured output's grammar)
shape what the picker and verifier see (`adjust.py`); a guided sequence's matcher advances by
every emitted token (`sequence.append_tokens`).

Token trees (`spec/tree.py`): a proposal may give a sequence's drafts parents; its rows then sit
at the positions of their depths, attend under a tree mask in the same ragged batch, and after
verification the keys and values of the accepted path move into the slots that follow the
context (a chain's path is already there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from quantspec.devices import device_done, device_memory_budget
from quantspec.errors import QuantSpecError
from quantspec.infer.adjust import adjust_step, guide_drafts
from quantspec.infer.backend import Runtime, default_runtime
from quantspec.infer.kv_cache import PagedAttention, PagedKVCache, kv_block_bytes
from quantspec.infer.logprobs import score_new_tokens, score_prompt_rows
from quantspec.infer.prefix_cache import PrefixCachingAllocator
from quantspec.infer.sampler import (SamplingParams, generator_for_request, greedy_ids, logits_to_probs, sample,
                                     sampling_tensors)
from quantspec.infer.scheduler import EngineConfig, Scheduler
from quantspec.infer.sequence import Sequence, SeqStats, append_tokens, count_drafts
from quantspec.infer.spec.tree import depths, prune, verify_trees
from quantspec.infer.structured import guide_matcher
from quantspec.infer.spec.types import SpecProposal
from quantspec.infer.spec.verify import verify_proposal
from quantspec.model_zoo.llama import Transformer

__all__ = ["DraftLimit", "Engine", "EngineConfig", "FeatureReader", "Proposer", "SeqStats", "Sequence", "StepInfo"]


@dataclass
class StepInfo:
    """What one step did: `decode` (decode / verification rows) or a prefill, the rows it fed,
    the sequences it served, the drafts they verified, its wall time (propose to record) and the
    forward's share of it (the model and the pick of its tokens)."""

    decode: bool
    rows: int
    num_seqs: int
    drafted: int
    seconds: float
    forward_seconds: float = 0.0


class DraftLimit(Protocol):
    """A per-step cap on drafts per sequence (load-aware speculation, `spec/load.py`)."""

    def cap(self, num_seqs: int) -> int:
        """The most drafts each of `num_seqs` decoding sequences may verify this step."""

    def observe(self, step: StepInfo, seqs: list["Sequence"], drafts: list[list[int]],
                accepted: list[int]) -> None:
        """Learn from a decode step: its cost, and per sequence its drafts and how many were accepted."""


class Proposer(Protocol):
    """A drafter: proposes up to `budget[b]` tokens for each decoding sequence."""

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> SpecProposal:
        """→ the drafts of each sequence (and the probs they were drawn from, or None)."""

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence (free draft-side state)."""


class FeatureReader(Protocol):
    """A proposer that also reads the base's residual streams of every forward of the engine
    (EAGLE-3's aux features), asked for explicitly: the engine's forwards `capture` them."""

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layer ids whose input streams each forward captures (id `num_layers`: the last
        layer's output)."""

    def file_streams(self, rows: list[tuple[Sequence, int]], token_ids: list[int], positions: list[int],
                     streams: tuple[torch.Tensor, ...]) -> None:
        """One forward's rows: (sequence, its query rows) in row order, the fed tokens and their
        positions [T], and the streams [T, D] in `capture_layers`' order."""


class Engine:
    """Continuous batching over `model` (module docstring). `runtime`: what the device backend
    prepared for the model (`LoadedModel.runtime`); None: the model's modules, with the device's
    attention kernel."""

    def __init__(self, model: Transformer, config: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 proposer: Proposer | None = None, runtime: Runtime | None = None):
        self.model, self.config, self.proposer = model, config, proposer
        args = model.args
        self.device = model.model.norm.weight.device
        self.dtype = model.model.norm.weight.dtype
        self.runtime = runtime or default_runtime(self.device)
        self.eos = set(eos_token_ids if eos_token_ids is not None else args.eos_token_ids)
        block_bytes = kv_block_bytes(num_layers=args.num_layers, block_size=config.block_size,
                                     num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=self.dtype,
                                     kv_dtype=config.kv_cache_dtype)
        self.cache = PagedKVCache.of(
            args, block_size=config.block_size,
            num_blocks=config.blocks_needed(block_bytes, device_memory_budget(self.device, config.gpu_memory_utilization)),
            dtype=self.dtype, device=self.device, kv_dtype=config.kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
            kernel=self.runtime.attention, max_seq_len=config.max_length + config.spec_max_draft_tokens + 1,
        )
        if args.max_position_embeddings < config.max_length:
            model.setup_rope(config.max_length + config.spec_max_draft_tokens + 1, self.device)
        self._next_id = 0
        self.keep_hidden = bool(getattr(proposer, "needs_hidden", False))
        # the residual streams a drafter reads from every forward (EAGLE-3's aux features): each
        # forward captures them and hands them to `proposer.file_streams` (`FeatureReader`)
        self.capture: tuple[int, ...] = (tuple(proposer.capture_layers(args.num_layers))
                                         if hasattr(proposer, "capture_layers") else ())
        if config.prefix_caching:
            # a reader of every prompt row of the base needs those rows, unless it keeps what it
            # read of cached blocks itself (EAGLE-3's head: `use_prefix_cache`)
            if config.all_hidden_rows or (self.capture and not hasattr(proposer, "use_prefix_cache")):
                raise QuantSpecError("prefix caching skips prompt rows that this drafter reads; drop "
                                     "--enable-prefix-caching")
            self.cache.allocator = PrefixCachingAllocator(self.cache.num_blocks, config.block_size)
            if self.capture:
                proposer.use_prefix_cache(config.block_size, self.cache.num_blocks)
        self.scheduler = Scheduler(config, self.cache.allocator,
                                   release=proposer.release if proposer is not None else None,
                                   window=self.cache.window if self.cache.window_layers is None else None)
        self.num_steps = 0
        # the forward of the current step, in row order: (sequence, query rows) — a prefill step
        # feeds only the prompts it prefills, so forward hooks must read this, not `running` (and
        # set `all_hidden_rows`, or a prefill's output holds only each prompt's last row)
        self.forward_rows: list[tuple[Sequence, int]] = []
        self.draft_limit: DraftLimit | None = None
        self.last_step: StepInfo | None = None

    @property
    def waiting(self) -> list[Sequence]:
        """Requests not yet admitted into the running batch, in arrival order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """The running batch, in admission order."""
        return self.scheduler.running

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_index: int | None = None,
                    text_check=None, priority: int = 0) -> Sequence:
        if not prompt_ids:
            raise QuantSpecError("empty prompt; give at least one token")
        if len(prompt_ids) >= self.config.max_length:
            raise QuantSpecError(
                f"prompt has {len(prompt_ids)} tokens but max_length is {self.config.max_length}; "
                f"raise --max-length or shorten the prompt"
            )
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise QuantSpecError(f"logit_bias names a token outside the model's vocabulary [0, {vocab}); drop it")
        if any(t >= vocab for t in params.allowed_token_ids):
            raise QuantSpecError(f"allowed_token_ids names a token outside the model's vocabulary [0, {vocab}); drop it")
        if priority and self.config.scheduling_policy != "priority":
            raise QuantSpecError(f"priority {priority} needs --scheduling-policy priority")
        idx = self._next_id if request_index is None else request_index
        seq = Sequence(self._next_id, list(prompt_ids), params,
                       generator_for_request(params.seed, idx, self.device), text_check=text_check)
        seq.stats.t_arrival = time.perf_counter()
        seq.guide = None if params.guide is None else guide_matcher(params.guide, params.guide_after)
        seq.priority = priority
        self._next_id += 1
        self.scheduler.enqueue(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Retire `seq` now (between steps): it leaves the batch and its KV blocks are free."""
        if seq.finished and not seq.block_table:
            return
        seq.finished, seq.finish_reason = True, "abort"
        seq.stats.t_finish = time.perf_counter()
        self.scheduler.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.scheduler.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one forward for every running sequence; returns (sequence, new token ids) pairs
        (a sequence whose prompt is still being prefilled in chunks gets none)."""
        # a step prefills admitted prompts alone, or runs the decode / verification rows of every
        # decoding sequence: decode rows never share a forward with a prefill
        t0 = time.perf_counter()
        plan = self.scheduler.plan()
        if not plan:
            return []
        seqs = [s for s, _ in plan]
        prefill = plan[0][1] > 0
        drafts, draft_probs, trees = self._propose(seqs) if not prefill else ([[] for _ in seqs], [None for _ in seqs],
                                                                              None)
        news = [s.tokens[s.num_cached:s.num_cached + n] if n else s.tokens[s.num_cached:] + d
                for (s, n), d in zip(plan, drafts)]
        t_forward = time.perf_counter()
        scored, ids, logits = self._forward(seqs, news, drafts, row_invariant=not prefill, trees=trees)
        device_done(self.device)  # the forward's kernels, not only their launches (the pick waits anyway)
        t_forward = time.perf_counter() - t_forward
        done = [i for i, (s, n) in enumerate(plan) if not n or s.num_cached + n == s.prefill_len]
        for s, n in plan:
            if n and s.num_cached + n < s.prefill_len:  # a chunk of a longer prefill: no token yet
                s.num_cached += n
        if len(done) < len(seqs):
            scored, seqs, drafts = scored[done], [seqs[i] for i in done], [[] for _ in done]
            ids = None if ids is None else [ids[i] for i in done]
            logits = None if logits is None else logits[done]
        pick_ids, pick_logits = ids, logits
        if any(s.params.adjusts_logits for s in seqs):
            pick_ids, pick_logits = adjust_step(self.model, self.eos, seqs, drafts, scored, ids, logits, trees)
        new_tokens, paths = (self._accept(seqs, drafts, [draft_probs[i] for i in done], pick_ids, pick_logits, trees)
                             if seqs else ([], None))
        accepted = [len(t) - 1 for t in new_tokens]
        events = self._record(seqs, drafts, new_tokens, scored, trees, paths, logits)
        for s, _ in plan:  # (a finished one was committed when its blocks were freed)
            self.scheduler.commit(s)
        self.last_step = StepInfo(not prefill, sum(map(len, news)), len(plan), sum(map(len, drafts)),
                                  time.perf_counter() - t0, t_forward)
        if not prefill and self.draft_limit is not None:
            self.draft_limit.observe(self.last_step, seqs, drafts, accepted)
        return events

    @torch.inference_mode()
    def dry_forward(self, q_lens: list[int]) -> float:
        """Seconds of a decode-like forward (kernels included) of len(q_lens) sequences bringing
        q_lens[b] rows each after a cached context (what is left of one KV block, at least one
        token), and the pick of every row's token: what a decode (every q 1) or verification
        step's forward costs, through the path such a step takes (the first forward of a shape
        captures its CUDA graph). Token 0 throughout, in KV blocks taken for it and given back:
        no sequence changes."""
        bs = self.config.block_size
        ctx = max(1, bs - max(q_lens))
        alloc, own, tables = self.cache.allocator, [], []
        for q in q_lens:
            n = -(-(ctx + q) // bs)
            shared = [t for t in own if len(t) >= n]
            if n > alloc.num_free and shared:  # a cache smaller than the batch: sequences share blocks
                tables.append(shared[len(tables) % len(shared)])
            else:
                own.append(alloc.allocate(n))
                tables.append(own[-1])
        try:
            t0 = time.perf_counter()
            meta = self.cache.metadata(q_lens, [ctx + q for q in q_lens], tables, self.device)
            ids = torch.zeros(sum(q_lens), dtype=torch.int64, device=self.device)
            pos = torch.cat([torch.arange(ctx, ctx + q) for q in q_lens]).to(self.device)
            hidden = self.model(ids, pos, PagedAttention(self.cache, meta), None, row_invariant=True,
                                stack=self.runtime.stack)
            if self.runtime.greedy is not None:
                self.runtime.greedy(hidden)
            else:
                self.model.compute_logits(hidden, row_invariant=True).argmax(-1)
            device_done(self.device)
            return time.perf_counter() - t0
        finally:
            for t in own:
                alloc.free(t)

    def warm_up(self) -> None:
        """Before serving: a dry decode step in each of the padded batch sizes the runtime's stack
        captures CUDA graphs for (its `buckets`) that a batch of up to max_batch_size sequences
        meets, so that no request waits while a graph is captured (a few eager steps' time) the
        first time its batch size occurs. Nothing where the stack captures none."""
        stack = self.runtime.stack
        if getattr(stack, "use_graphs", False):
            for n in sorted({min(b, self.config.max_batch_size) for b in stack.buckets}):
                self.dry_forward([1] * n)

    def _propose(self, seqs: list[Sequence]
                 ) -> tuple[list[list[int]], list[torch.Tensor | None], list[list[int] | None] | None]:
        """Each decoding sequence's drafts, at most its budget, the draft probs [k_b, V] they were
        drawn from (None: deterministic) and, where the proposer drafts token trees, each
        sequence's parent rows (None: a chain; trees None: only chains). A tree keeps at most
        `spec_max_draft_tokens` drafts, none deeper than the budget."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[torch.Tensor | None] = [None for _ in seqs]
        trees: list[list[int] | None] = [None for _ in seqs]
        if self.proposer is None or not seqs:
            return drafts, probs, None
        cap = self.config.spec_max_draft_tokens
        if self.draft_limit is not None:
            cap = min(cap, self.draft_limit.cap(sum(s.speculate for s in seqs)))
        budgets = [self.scheduler.draft_budget(s, cap) for s in seqs]
        proposal = self.proposer.propose(seqs, budgets)
        for i in range(len(seqs)):
            ids, q, par = proposal.draft_token_ids[i], proposal.probs_of(i), proposal.parents_of(i)
            if par is None:
                keep = slice(0, budgets[i])
            else:
                kept, trees[i] = prune(par, self.config.spec_max_draft_tokens, budgets[i])
                keep = torch.tensor(kept, dtype=torch.int64)
            drafts[i] = ids[keep].tolist()
            probs[i] = None if q is None else q[keep.to(q.device) if par is not None else keep]
        guide_drafts(seqs, drafts, probs, trees)  # guided chains: the drafts their grammar allows
        return drafts, probs, (trees if any(t is not None for t in trees) else None)

    def _feed(self, seqs: list[Sequence], news: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
        """(token ids fed, new rows per sequence, context length per sequence) of a step; takes
        the KV blocks the new rows need."""
        feed_ids: list[int] = []
        q_lens, seq_lens = [], []
        for seq, new in zip(seqs, news):
            self.scheduler.ensure_blocks(seq, seq.num_cached + len(new))
            feed_ids.extend(new)
            q_lens.append(len(new))
            seq_lens.append(seq.num_cached + len(new))
        return feed_ids, q_lens, seq_lens

    def _forward(self, seqs: list[Sequence], news: list[list[int]], drafts: list[list[int]], row_invariant: bool,
                 trees: list[list[int] | None] | None = None
                 ) -> tuple[torch.Tensor, list[int] | None, torch.Tensor | None]:
        """One forward over the step's new rows → (the scored rows' pre-norm hidden [R, D], their
        greedy ids when every sequence is greedy and the runtime has a picker, else None, their
        logits [R, V] fp32 when there are no ids). Scored rows: each sequence's last fed row and
        its draft rows (every row of a decode step; of a prefill, each prompt's last)."""
        feed_ids, q_lens, seq_lens = self._feed(seqs, news)
        positions = torch.cat([torch.arange(sl - ql, sl) if trees is None or trees[b] is None
                               else sl - ql + torch.tensor(depths(trees[b]))  # a tree row: its depth
                               for b, (ql, sl) in enumerate(zip(q_lens, seq_lens))])
        meta = self.cache.metadata(q_lens, seq_lens, [s.block_table for s in seqs], self.device, trees)
        input_ids = torch.tensor(feed_ids, dtype=torch.int64, device=self.device)
        self.forward_rows = list(zip(seqs, q_lens))
        rows, prompt_rows, offset = [], [], 0
        for seq, ql, d in zip(seqs, q_lens, drafts):
            rows.extend(range(offset + ql - 1 - len(d), offset + ql))
            if (seq.params.prompt_logprobs is not None and seq.num_cached < len(seq.prompt_ids)
                    and len(seq.prompt_logprobs) < len(seq.prompt_ids)):  # (not again after a preemption)
                # a prefill chunk's rows that predict prompt tokens (the last one's is a scored row)
                n = min(ql, len(seq.prompt_ids) - 1 - seq.num_cached)
                prompt_rows.append((seq, list(range(offset, offset + n))))
            offset += ql
        wanted = sorted(set(rows).union(*(r for _, r in prompt_rows))) if prompt_rows else rows
        row_idx = torch.tensor(wanted, device=self.device) if len(wanted) < len(feed_ids) else None
        out_rows = None if self.config.all_hidden_rows else row_idx
        scored = self.model(input_ids, positions.to(self.device), PagedAttention(self.cache, meta), out_rows,
                            row_invariant=row_invariant, stack=self.runtime.stack, capture=self.capture)  # [R, D]
        if self.capture:
            scored, streams = scored  # streams: the captured ids' [T, D] each
            self.proposer.file_streams(self.forward_rows, feed_ids, positions.tolist(), streams)
        if row_idx is not None and out_rows is None:
            scored = scored[row_idx]
        if prompt_rows:
            at = {r: i for i, r in enumerate(wanted)}
            score_prompt_rows(self.model, prompt_rows, scored, at)
            if len(wanted) > len(rows):
                scored = scored[torch.tensor([at[r] for r in rows], device=self.device)]
        ids = None
        if self.runtime.greedy is not None and all(s.params.is_greedy for s in seqs):
            ids = self.runtime.greedy(scored)
        logits = self.model.compute_logits(scored, row_invariant=row_invariant) if ids is None else None  # [sum(1+k_b), V]
        return scored, ids, logits

    def _accept(self, seqs: list[Sequence], drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                ids: list[int] | None, logits: torch.Tensor | None, trees: list[list[int] | None] | None = None
                ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Each sequence's new tokens: its accepted drafts and one more token (the verifier), or
        one sampled / greedy token where nothing was drafted; and with trees, each sequence's
        accepted path of rows (else None)."""
        if not any(drafts):
            return [[int(t)] for t in (ids if ids is not None else self._sample(logits, seqs))], None
        if trees is not None:
            shaped = [(d, list(range(len(d))) if t is None else t) for d, t in zip(drafts, trees)]
            paths, outs = verify_trees(shaped, draft_probs, logits, [s.params for s in seqs],
                                       [s.generator for s in seqs], target_ids=ids)
            return outs, paths
        proposal = SpecProposal([torch.tensor(d, dtype=torch.int64) for d in drafts], draft_probs)
        result = verify_proposal(proposal, logits, [s.params for s in seqs], [s.generator for s in seqs],
                                 target_ids=ids)
        return [list(map(int, t)) for t in result.output_tokens], None

    def _record(self, seqs: list[Sequence], drafts: list[list[int]], new_tokens: list[list[int]],
                scored: torch.Tensor, trees: list[list[int] | None] | None = None,
                paths: list[list[int]] | None = None, logits: torch.Tensor | None = None
                ) -> list[tuple[Sequence, list[int]]]:
        """Append the new tokens (and their log-probabilities where asked for), count what was
        accepted, retire finished sequences. `logits`: the scored rows' [R, V], where the step
        computed them."""
        now = time.perf_counter()
        out: list[tuple[Sequence, list[int]]] = []
        first_row = 0
        wants: list[tuple[Sequence, list[int], list[int]]] = []  # (sequence, its tokens' rows, tokens)
        for b, (seq, d, toks) in enumerate(zip(seqs, drafts, new_tokens)):
            path = list(range(len(toks))) if paths is None else paths[b]
            base, first_row = first_row, first_row + 1 + len(d)  # this sequence's scored rows start at base
            if self.keep_hidden:  # the row whose logits produced the newest token
                seq.last_hidden = scored[base + path[-1]]
            if paths is not None:
                self._compact(seq, path)
            if seq.output_ids:
                seq.stats.target_forwards += 1
            seq.num_cached = seq.num_tokens + len(toks) - 1  # fed tokens + accepted drafts are valid KV
            if seq.stats.t_first_token is None:
                seq.stats.t_first_token = now
            emitted = append_tokens(seq, toks, self.eos, self.config.max_length)
            if seq.params.logprobs is not None and emitted:
                wants.append((seq, [base + path[j] for j in range(len(emitted))], emitted))
            if d:
                tree = None if trees is None else trees[b]
                count_drafts(seq.stats, len(d), len(toks) - 1, len(emitted),
                                   None if tree is None else max(depths(tree)))
            out.append((seq, emitted))
        if wants:
            score_new_tokens(self.model, wants, scored, logits)
        for seq in [s for s in seqs if s.finished]:
            seq.stats.t_finish = now
            self._free(seq)
        self.scheduler.retire_finished()
        self.num_steps += 1
        return out

    def _compact(self, seq: Sequence, path: list[int]) -> None:
        """Move the keys / values of a tree's accepted rows (path [0, r_1, .., r_m], rows counted
        from the sequence's first fed row at `num_cached`) to positions num_cached + 1 .. + m."""
        src, dst = [], []
        bs = self.config.block_size
        for i, r in enumerate(path):
            if r != i:
                for pos, out in ((seq.num_cached + r, src), (seq.num_cached + i, dst)):
                    out.append(seq.block_table[pos // bs] * bs + pos % bs)
        self.cache.move(src, dst)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if all(s.params.is_greedy for s in seqs):
            return greedy_ids(logits)
        probs = logits_to_probs(logits, *sampling_tensors([s.params for s in seqs], self.device))
        sampled = sample(probs, [s.generator for s in seqs])
        greedy = logits.argmax(dim=-1)
        return [int(greedy[i]) if s.params.is_greedy else int(sampled[i]) for i, s in enumerate(seqs)]

    def run(self, on_step: Callable[[list[tuple[Sequence, list[int]]]], None] | None = None) -> None:
        while self.has_work():
            events = self.step()
            if on_step is not None:
                on_step(events)
