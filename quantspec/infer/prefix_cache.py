"""Automatic prefix caching: full KV blocks of committed tokens stay findable by their content, so a
prompt that begins with tokens the cache already holds (a shared system prompt, the earlier turns
of a chat, a few-shot preamble) skips their prefill.

A block's *hash* is a digest of its parent block's hash and its own `block_size` token ids, so it
names the whole prefix up to the block's end: equal hashes mean equal tokens at equal positions,
hence equal keys and values (the same model wrote them). BLAKE2b with 16-byte digests: a chance
collision is out of reach, as with vLLM's sha256 option.

`PrefixCachingAllocator` is a `BlockAllocator` whose blocks carry reference counts:

- `register(block, hash)` makes a block findable once every position in it holds the KV of a
  committed token (a prompt token, or an emitted output token; never a draft);
- `match(tokens, max_blocks)` returns the cached blocks of the longest run of whole leading
  blocks of `tokens`, each taken once more;
- `free` releases a sequence's hold; a block no sequence holds any more stays findable (it is
  *evictable*) until `allocate` needs it, least recently freed first.

A matched block is only ever read: the sequence that takes it starts writing at the first
position after it. The last prompt token is never matched (its row gives the first output
token's logits), so a prompt matches at most (len - 1) // block_size blocks.

Example, block_size 2: a sequence with tokens [5, 6, 7, 8, 9] registers the blocks of [5, 6] and
[5, 6, 7, 8]; a later prompt [5, 6, 7, 8, 1] matches both (4 tokens skip prefill), [5, 6, 7, 9]
matches the first only, [6, 5, ...] nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from quantspec.infer.kv_cache import BlockAllocator

__all__ = ["PrefixCachingAllocator", "block_hashes"]

_ROOT = b""  # the parent hash of a sequence's first block


def block_hashes(tokens: list[int], block_size: int, start: list[bytes] | None = None,
                 num_blocks: int | None = None) -> list[bytes]:
    """The hashes of the whole leading blocks of `tokens` (at most `num_blocks`), continuing `start`
    (the hashes of the first len(start) blocks, already known)."""
    out = list(start or [])
    n = len(tokens) // block_size if num_blocks is None else min(num_blocks, len(tokens) // block_size)
    for i in range(len(out), n):
        h = hashlib.blake2b(out[-1] if out else _ROOT, digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        out.append(h.digest())
    return out


class PrefixCachingAllocator(BlockAllocator):
    """Free blocks, reference-counted blocks in use, and findable blocks of committed prefixes
    (module docstring). `queries` / `hits`: prompt tokens looked up and found, since it was built."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks)
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # block in use → sequences holding it
        self._block_of: dict[bytes, int] = {}  # hash → the block that holds that prefix's last tokens
        self._hash_of: dict[int, bytes] = {}
        # findable blocks no sequence holds, least recently freed first: what `allocate` evicts
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = self.hits = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: the free ones and the evictable ones."""
        return self._num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Findable blocks, held by a sequence or evictable."""
        return len(self._hash_of)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        while self._num_free < n <= self.num_free:  # (else the base class says the cache is full)
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            super().free([block])
        ids = super().allocate(n, after=after)
        for b in ids:
            self._refs[b] = 1
        return ids

    def free(self, blocks: list[int]) -> None:
        plain = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                plain.append(b)
        super().free(plain)

    def register(self, block: int, block_hash: bytes) -> None:
        """Make `block` (held by a sequence, every position of it committed) findable as `block_hash`.
        Where another block already holds that prefix (two prompts prefilled at once), this one
        stays private and is freed as usual."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def match(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """The blocks of the longest run of leading `hashes` the cache holds, each now held once
        more by the caller; counts `num_tokens` queried prompt tokens and the matched ones."""
        blocks = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        for b in blocks:
            if b in self._evictable:
                del self._evictable[b]
            self._refs[b] = self._refs.get(b, 0) + 1
        self.queries += num_tokens
        self.hits += len(blocks) * self.block_size
        return blocks
