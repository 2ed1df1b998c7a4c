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
"""

from __future__ import annotations

from dataclasses import dataclass

from quantspec.errors import QuantSpecError
from quantspec.infer.kv_cache import BlockAllocator, KVCacheDtype
from quantspec.infer.prefix_cache import block_hashes
from quantspec.infer.sequence import Sequence

__all__ = ["PREFILL_TOKENS", "EngineConfig", "Scheduler"]

# prompt tokens one prefill step takes at most, by default: one huge forward over every prompt of a
# batch spills its activations ([T, intermediate] fp32) out of the caches; a few medium ones do not
PREFILL_TOKENS = 1024


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
        self.kv_cache_dtype = KVCacheDtype(self.kv_cache_dtype)

    def blocks_needed(self) -> int:
        per_seq = -(-(self.max_length + self.spec_max_draft_tokens + 1) // self.block_size)
        return self.num_blocks or (self.max_batch_size * per_seq + 1)


class Scheduler:
    """The waiting queue and the running batch over the cache's `allocator` (module docstring)."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config, self.allocator = config, allocator
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._prefilled_last = False  # the previous step was a prefill (chunked prefill alternates)

    def ensure_blocks(self, seq: Sequence, num_positions: int) -> None:
        """Give `seq` the blocks of its first `num_positions` positions."""
        need = -(-num_positions // self.config.block_size) - len(seq.block_table)
        if need > 0:
            after = seq.block_table[-1] if seq.block_table else None
            seq.block_table.extend(self.allocator.allocate(need, after=after))

    def free(self, seq: Sequence) -> None:
        self.commit(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def _match(self, seq: Sequence) -> None:
        """With prefix caching, start `seq` on the cached blocks of its prompt's longest cached run
        of whole leading blocks (never its last token; none where it asks for prompt
        log-probabilities, which need every prompt row)."""
        bs = self.config.block_size
        if seq.params.prompt_logprobs is not None:
            return
        hashes = block_hashes(seq.prompt_ids, bs, num_blocks=(len(seq.prompt_ids) - 1) // bs)
        seq.block_table = self.allocator.match(hashes, len(seq.prompt_ids))
        seq.block_hashes = hashes[:len(seq.block_table)]
        seq.num_cached = seq.stats.cached_tokens = len(seq.block_table) * bs

    def commit(self, seq: Sequence) -> None:
        """With prefix caching, make the blocks of `seq` findable whose every position holds a
        committed token's keys and values (a prompt's prefilled tokens, emitted output tokens)."""
        n = min(seq.num_cached, seq.num_tokens) // self.config.block_size
        if self.config.prefix_caching and seq.block_table and n > len(seq.block_hashes):
            known = len(seq.block_hashes)
            seq.block_hashes = block_hashes(seq.tokens, self.config.block_size, seq.block_hashes, n)
            for block, h in zip(seq.block_table[known:n], seq.block_hashes[known:]):
                self.allocator.register(block, h)

    def _reserve(self, seq: Sequence) -> None:
        """At admission, take every block the sequence can reach (its prompt, max_new_tokens and
        the draft room) as one run when the cache has it: consecutive blocks are read as a view
        by the attention (no per-step gathers). Otherwise only the prompt's blocks."""
        reach = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.config.max_length)
        positions = reach + self.config.spec_max_draft_tokens + 1
        if -(-positions // self.config.block_size) - len(seq.block_table) > self.allocator.num_free:
            positions = len(seq.prompt_ids) + 1
        self.ensure_blocks(seq, positions)

    def admit(self) -> None:
        """Move waiting sequences into the running batch while it has room."""
        # num_blocks is sized for max_batch_size full-length sequences, so admission only has to
        # respect the batch size; a smaller user-set num_blocks is checked against the prompt.
        while self.waiting and len(self.running) < self.config.max_batch_size:
            prompt_blocks = -(-(len(self.waiting[0].prompt_ids) + 1) // self.config.block_size)
            if self.allocator.num_free < prompt_blocks:
                if not self.running:
                    raise QuantSpecError("the KV cache cannot hold one prompt; raise num_blocks")
                break
            seq = self.waiting.pop(0)
            if self.config.prefix_caching:
                self._match(seq)
            self._reserve(seq)
            self.running.append(seq)

    def prefill_batch(self) -> list[tuple[Sequence, int]]:
        """The admitted prompts that prefill this step and how many of their tokens: in admission
        order, up to `prefill_tokens` (at least one prompt), each prompt whole or, with
        `prefill_chunk`, its next chunk."""
        chunk = self.config.prefill_chunk
        fresh, tokens = [], 0
        for s in self.running:
            if not s.output_ids:
                n = len(s.prompt_ids) - s.num_cached
                n = min(n, chunk) if chunk else n
                if fresh and tokens + n > self.config.prefill_tokens:
                    break
                fresh.append((s, n))
                tokens += n
        return fresh

    def plan(self) -> list[tuple[Sequence, int]]:
        """This step's sequences, after admitting what fits: the prompts to prefill (with their
        token counts), or every decoding sequence (count 0: its new token and drafts)."""
        self.admit()
        fresh = self.prefill_batch()
        decoding = any(s.output_ids for s in self.running)
        prefill = bool(fresh) and not (self.config.prefill_chunk and self._prefilled_last and decoding)
        self._prefilled_last = prefill
        return fresh if prefill else [(s, 0) for s in self.running if s.output_ids]

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
        return max(0, min(cap, left_new, left_len))
