"""The scheduler: which sequences each engine step serves, and the KV blocks they hold.

Requests wait in arrival order and are admitted into the running batch while it has room
(`max_batch_size`) and the cache has the blocks of their prompt. A step then either prefills or
decodes, never both (decode rows are row-invariant, prefill rows are not; see `engine.py`):

- A prefill step takes the admitted prompts still to be prefilled, in admission order, up to
  `prefill_tokens` prompt tokens (at least one prompt or chunk). With `prefill_chunk` each prompt
  gives at most one chunk per step, its chunks cut at multiples of the chunk from its start (so a
  prompt's chunks never depend on its neighbours): a long prompt takes one chunk's share of the
  step's budget and the prompts behind it fill the rest, so a burst of arrivals gets its first
  tokens in a few steps and no prompt waits behind another's whole prefill.
- With `prefill_chunk`, a decode step follows each prefill step while sequences are decoding:
  running streams are delayed by at most one prefill step's forward at a time. Without it,
  admitted prompts are prefilled before any decode step.

With `prefix_caching` (`prefix_cache.py`) an admitted prompt starts on the cached blocks of its
longest cached run of whole leading blocks, its prefill skipping their tokens, and a sequence's
blocks become findable as their positions fill with committed tokens (`commit`, after each step
and when the sequence is freed).

KV blocks. A cache of the default size holds `max_batch_size` sequences of `max_length`: a
sequence takes at admission every block it can reach, and no step ever waits for one. A smaller
cache (`kv_cache_memory`, or one cut to a GPU's memory) admits a sequence while the free blocks
hold its prompt and a reserve (`watermark`) for the running ones to grow into; the sequence takes
every block it can reach where the free blocks also hold the prompts still waiting, else blocks
as positions fill; and when a decoding sequence needs a block that none is free for, the
scheduler preempts the running sequence that arrived last (recompute, as vLLM does): its blocks
go back, it waits ahead of every request that came after it, and once readmitted a prefill of
every token it had restores its keys and values and gives its next token
(`Sequence.prefill_len`). Sampled sequences keep their random streams, so a preemption changes an
answer only by the rounding of a prefill against decode steps (as chunked prefill and prefix
caching do); with prefix caching, its committed blocks are found again. A sequence gets no drafts
in a step the free blocks cannot hold them in. Where every layer of the model attends within a
sliding window (Mistral's, Phi-3's), a bounded cache takes back the blocks a sequence's window
has passed before each step, so a long generation holds about a window's blocks, not its length's.

Order. Under the "fcfs" `scheduling_policy` requests are admitted in arrival order and the most
recently arrived running sequence is the one preempted. Under "priority" (vLLM's) each request
has a `priority` (lower first; 0 by default) and the order is (priority, arrival): the waiting
queue is kept in it, the last running sequence in it is the one preempted, and a request that
finds no free slot or blocks preempts running sequences of a larger priority value to make them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

from quantspec.errors import QuantSpecError
from quantspec.infer.kv_cache import PAD_BLOCK, BlockAllocator, KVCacheDtype
from quantspec.infer.prefix_cache import block_hashes
from quantspec.infer.sequence import Sequence
from quantspec.sizes import format_size

__all__ = ["PREFILL_TOKENS", "SCHEDULING_POLICIES", "EngineConfig", "Scheduler"]

# prompt tokens one prefill step takes at most, by default: one huge forward over every prompt of a
# batch spills its activations ([T, intermediate] fp32) out of the caches; a few medium ones do not
PREFILL_TOKENS = 1024
SCHEDULING_POLICIES = ("fcfs", "priority")


def _rank(seq: Sequence) -> tuple[int, int]:
    """A sequence's place in the scheduling order: (priority, arrival)."""
    return seq.priority, seq.seq_id


@dataclass
class EngineConfig:
    block_size: int = 64
    max_batch_size: int = 8
    max_length: int = 2048  # prompt + generated tokens, per sequence
    kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO
    num_blocks: int | None = None  # default: enough for max_batch_size full-length sequences
    spec_max_draft_tokens: int = 0  # extra KV room per sequence for verification
    # the forward returns every fed row's hidden state (for forward hooks that read them, e.g.
    # train-mtp's self-distillation); by default a prefill returns each prompt's last row only,
    # which lets a stack runner skip the last layer's o projection and MLP for the others
    all_hidden_rows: bool = False
    # prompts are cut into chunks of this many tokens, one chunk per prompt per prefill step, and
    # prefill steps alternate with decode steps (module docstring); None: whole prompts, all
    # prefilled before any decode step
    prefill_chunk: int | None = None
    # prompt tokens per prefill step, at most (a longer prompt or chunk still goes in one step)
    prefill_tokens: int = PREFILL_TOKENS
    # automatic prefix caching (`prefix_cache.py`): a prompt skips the prefill of its leading whole
    # blocks that the cache holds from earlier sequences; needs a `PrefixCachingAllocator`
    prefix_caching: bool = False
    # bytes of keys and values the cache holds (every layer): as many blocks as fit, and a batch
    # of as many sequences as they hold, up to max_batch_size, preempting where they run out
    # (module docstring); None: `num_blocks`, else enough for max_batch_size sequences of max_length
    kv_cache_memory: int | None = None
    # "fcfs": arrival order; "priority": each request's priority first (module docstring)
    scheduling_policy: str = "fcfs"
    # on CUDA, without kv_cache_memory: the share of the device's memory in use at most once the
    # cache is allocated; a default-size cache that would pass it is cut to what fits (bounded)
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise QuantSpecError(f"--block-size {self.block_size} must be a power of two (e.g. 64)")
        if self.max_batch_size < 1:
            raise QuantSpecError(f"--batch-size {self.max_batch_size} must be >= 1")
        if self.max_length < 2:
            raise QuantSpecError(f"--max-length {self.max_length} must be >= 2")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool) or self.prefill_chunk < 1):
            raise QuantSpecError(f"--prefill-chunk {self.prefill_chunk} must be >= 1")
        if isinstance(self.prefill_tokens, bool) or self.prefill_tokens < 1:
            raise QuantSpecError(f"--max-prefill-tokens {self.prefill_tokens} must be >= 1")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool) or self.kv_cache_memory < 1):
            raise QuantSpecError(f"--kv-cache-memory {self.kv_cache_memory} must be a positive size (e.g. 4GiB)")
        if isinstance(self.gpu_memory_utilization, bool) or not 0 < self.gpu_memory_utilization <= 1:
            raise QuantSpecError(f"--gpu-memory-utilization {self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise QuantSpecError(f"--scheduling-policy {self.scheduling_policy!r} is not one of "
                                 f"{', '.join(SCHEDULING_POLICIES)}")
        self.kv_cache_dtype = KVCacheDtype(self.kv_cache_dtype)

    @property
    def blocks_per_sequence(self) -> int:
        """The blocks one sequence of max_length takes with its verification rows."""
        return -(-(self.max_length + self.spec_max_draft_tokens + 1) // self.block_size)

    @property
    def full_blocks(self) -> int:
        """The default cache's blocks: max_batch_size sequences of max_length, and the padding block."""
        return self.max_batch_size * self.blocks_per_sequence + 1

    def blocks_needed(self, block_bytes: int | None = None, device_budget: int | None = None) -> int:
        """The cache's blocks (the padding block included): `num_blocks`; or what
        `kv_cache_memory` holds at `block_bytes` a block; or max_batch_size full sequences', cut to
        what `device_budget` bytes hold where they are fewer (`devices.device_memory_budget`).
        A memory that cannot hold one sequence of max_length is a clear error."""
        if self.num_blocks:
            return self.num_blocks
        full = self.full_blocks
        memory, flag = self.kv_cache_memory, "--kv-cache-memory"
        if memory is None and device_budget is not None and block_bytes and full * block_bytes > device_budget:
            memory, flag = max(0, device_budget), "--gpu-memory-utilization"
        if memory is None or not block_bytes:
            return full
        n = memory // block_bytes
        if n - 1 < self.blocks_per_sequence:
            need = (self.blocks_per_sequence + 1) * block_bytes
            raise QuantSpecError(
                f"the KV cache gets {format_size(memory)} ({flag}), {max(0, n - 1) * self.block_size} tokens; "
                f"one sequence of --max-length {self.max_length} needs {format_size(need)}: raise {flag} or "
                f"lower --max-length")
        return n


class Scheduler:
    """The waiting queue and the running batch over the cache's `allocator` (module docstring)."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator,
                 release: Callable[[Sequence], None] | None = None, window: int | None = None):
        self.config, self.allocator = config, allocator
        self.window = window  # the sliding window of a model whose every layer slides (`_slide`)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._prefilled_last = False  # the previous step was a prefill (chunked prefill alternates)
        # a cache smaller than max_batch_size full sequences: blocks as positions fill, preemption
        self.bounded = allocator.num_blocks < config.full_blocks
        self.watermark = max(1, allocator.num_blocks // 100) if self.bounded else 0
        self.release = release  # told of a preempted sequence (its drafter's state goes with its blocks)
        self.num_preemptions = 0
        self.num_slid_blocks = 0  # blocks given back behind a window (`_slide`)

    def ensure_blocks(self, seq: Sequence, num_positions: int) -> None:
        """Give `seq` the blocks of its first `num_positions` positions."""
        need = -(-num_positions // self.config.block_size) - len(seq.block_table)
        if need > 0:
            after = seq.block_table[-1] if seq.block_table else None
            seq.block_table.extend(self.allocator.allocate(need, after=after))

    def free(self, seq: Sequence) -> None:
        self.commit(seq)
        self.allocator.free([b for b in seq.block_table if b != PAD_BLOCK])
        seq.block_table = []

    def _slide(self, seq: Sequence) -> None:
        """Give back the leading blocks of `seq` that no row of it attends again: where every layer
        attends within a window of W, the next rows start at position `num_cached`, whose keys begin
        at num_cached - W + 1, and positions never move back (rejected drafts only lie beyond it).
        Their table entries become the padding block (position → slot stays as it was for the
        rest); with prefix caching they stay findable, committed first."""
        n = min(max(0, seq.num_cached - self.window + 1) // self.config.block_size, len(seq.block_table))
        behind = [i for i in range(n) if seq.block_table[i] != PAD_BLOCK]
        if behind:
            self.commit(seq)
            self.allocator.free([seq.block_table[i] for i in behind])
            for i in behind:
                seq.block_table[i] = PAD_BLOCK
            self.num_slid_blocks += len(behind)

    def _match(self, seq: Sequence) -> None:
        """With prefix caching, start `seq` on the cached blocks of its prompt's longest cached run
        of whole leading blocks (never its last token; none where it asks for prompt
        log-probabilities, which need every prompt row)."""
        bs = self.config.block_size
        if seq.params.prompt_logprobs is not None:
            return
        hashes = block_hashes(seq.tokens, bs, num_blocks=(seq.prefill_len - 1) // bs)
        seq.block_table = self.allocator.match(hashes, seq.prefill_len)
        seq.block_hashes = hashes[:len(seq.block_table)]
        seq.num_cached = len(seq.block_table) * bs
        if not seq.stats.preemptions:  # (what its recompute finds is not its prompt's)
            seq.stats.cached_tokens = seq.num_cached

    def commit(self, seq: Sequence) -> None:
        """With prefix caching, make the blocks of `seq` findable whose every position holds a
        committed token's keys and values (a prompt's prefilled tokens, emitted output tokens)."""
        n = min(seq.num_cached, seq.num_tokens) // self.config.block_size
        if self.config.prefix_caching and seq.block_table and n > len(seq.block_hashes):
            known = len(seq.block_hashes)
            seq.block_hashes = block_hashes(seq.tokens, self.config.block_size, seq.block_hashes, n)
            for block, h in zip(seq.block_table[known:n], seq.block_hashes[known:]):
                self.allocator.register(block, h)

    def _reserve(self, seq: Sequence, spare: int) -> None:
        """At admission, take the blocks of what the sequence's prefill computes and its first
        token, and where `spare` of the free blocks can go to it, every block it can reach (its
        prompt, max_new_tokens and the draft room) as one run: consecutive blocks are read as a
        view by the attention (no per-step gathers)."""
        positions = seq.prefill_len + 1
        reach = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.config.max_length)
        room = -(-(reach + self.config.spec_max_draft_tokens + 1) // self.config.block_size)
        if room - len(seq.block_table) <= spare:
            positions = reach + self.config.spec_max_draft_tokens + 1
        self.ensure_blocks(seq, positions)

    def enqueue(self, seq: Sequence) -> None:
        """Queue `seq` in its place: the waiting queue is in (priority, arrival) order."""
        bisect.insort(self.waiting, seq, key=_rank)

    def admit(self) -> None:
        """Move waiting sequences into the running batch while it has room: a free slot, and free
        blocks for the prefill (beyond the watermark, in a bounded cache); under the priority
        policy, room made by preempting running sequences of a larger priority value. A sequence
        takes every block it can reach where the cache is of the default size, or in a bounded one
        where that leaves the blocks of the waiting prompts and the watermark free."""
        bs = self.config.block_size
        pending = None  # the waiting prompts' blocks (bounded cache), summed once a sequence is admitted
        while self.waiting:
            seq = self.waiting[0]
            blocks = -(-(seq.prefill_len + 1) // bs)
            slot = len(self.running) < self.config.max_batch_size
            if not slot or self.allocator.num_free < blocks + (self.watermark if self.running else 0):
                if not self.running:
                    raise QuantSpecError("the KV cache cannot hold one prompt; raise --kv-cache-memory")
                last = self._last_running()
                if self.config.scheduling_policy == "priority" and last.priority > seq.priority:
                    self.preempt(last)
                    continue
                break
            if pending is None:
                pending = sum(-(-(s.prefill_len + 1) // bs) for s in self.waiting) if self.bounded else 0
            self.waiting.pop(0)
            pending -= blocks
            if self.config.prefix_caching:
                self._match(seq)
            self._reserve(seq, self.allocator.num_free - (pending + self.watermark if self.bounded else 0))
            self.running.append(seq)
            if seq.stats.t_scheduled is None:
                seq.stats.t_scheduled = time.perf_counter()

    def preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back and queue it in its place, to be prefilled again from its first
        token (module docstring)."""
        self.free(seq)
        seq.num_cached, seq.block_hashes, seq.prefill_len = 0, [], seq.num_tokens
        self.running.remove(seq)
        self.enqueue(seq)
        self.num_preemptions += 1
        seq.stats.preemptions += 1
        if self.release is not None:
            self.release(seq)

    def _last_running(self) -> Sequence:
        """The running sequence last in the scheduling order: the one preempted first."""
        return max(self.running, key=_rank)

    def _make_room(self) -> None:
        """Before a decode step: the blocks of every decoding sequence's next position, preempting
        the last running sequences in the scheduling order (the one in need too, if it is the
        last) while the cache has too few. (A preempted sequence is prefilling again: skipped.)"""
        for seq in list(self.running):
            if seq.prefilling:
                continue
            need = -(-seq.num_tokens // self.config.block_size) - len(seq.block_table)
            while need > self.allocator.num_free and not seq.prefilling:
                self.preempt(self._last_running())
            if not seq.prefilling:
                self.ensure_blocks(seq, seq.num_tokens)

    def prefill_batch(self) -> list[tuple[Sequence, int]]:
        """The admitted prompts that prefill this step and how many of their tokens: in admission
        order, up to `prefill_tokens` (at least one prompt), each prompt whole or, with
        `prefill_chunk`, its next chunk."""
        chunk = self.config.prefill_chunk
        fresh, tokens = [], 0
        for s in self.running:
            if s.prefilling:
                n = s.prefill_len - s.num_cached
                n = min(n, chunk) if chunk else n
                if fresh and tokens + n > self.config.prefill_tokens:
                    break
                fresh.append((s, n))
                tokens += n
        return fresh

    def plan(self) -> list[tuple[Sequence, int]]:
        """This step's sequences, after admitting what fits: the prompts to prefill (with their
        token counts), or every decoding sequence (count 0: its new token and drafts). In a bounded
        cache of a model whose every layer slides, the blocks behind each window go back first."""
        if self.window is not None and self.bounded:
            for s in self.running:
                self._slide(s)
        self.admit()
        fresh = self.prefill_batch()
        decoding = any(not s.prefilling for s in self.running)
        prefill = bool(fresh) and not (self.config.prefill_chunk and self._prefilled_last and decoding)
        self._prefilled_last = prefill
        if prefill:
            return fresh
        if self.bounded:
            self._make_room()
        return [(s, 0) for s in self.running if not s.prefilling]

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queue and the batch (an abort)."""
        self.waiting = [s for s in self.waiting if s is not seq]
        self.running = [s for s in self.running if s is not seq]

    def retire_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def draft_budget(self, seq: Sequence, cap: int) -> int:
        """How many draft tokens `seq` may verify this step (at most `cap`)."""
        if not seq.speculate:
            return 0
        left_new = seq.params.max_new_tokens - len(seq.output_ids) - 1
        left_len = self.config.max_length - seq.num_tokens - 1
        budget = max(0, min(cap, left_new, left_len))
        if budget and self.bounded:  # room for the most rows a proposal brings (a tree's may pass its depth)
            need = -(-(seq.num_tokens + self.config.spec_max_draft_tokens) // self.config.block_size)
            if need - len(seq.block_table) > self.allocator.num_free:
                return 0
            self.ensure_blocks(seq, seq.num_tokens + self.config.spec_max_draft_tokens)
        return budget
