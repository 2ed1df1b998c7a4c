"""The EAGLE-3 head's cache rows of whole prefix blocks, kept so that a prompt whose leading blocks
come from the base's prefix cache (`infer/prefix_cache.py`) gets its head rows without the base
features the skipped prefill would have given.

The head's row p reads fc(features of p) and the token t_{p+1}: its keys and values are a function
of the tokens 0..p+1. So the rows a block's hash (the tokens up to the block's end, position e - 1)
determines are the rows bB - 1 .. e - 2: the previous block's last row (its next token is this
block's first) and this block's rows but its last. An entry keeps those rows' keys and values,
and the features of the block's last position, with which a sequence whose cached prefix ends at
the block computes that row with its own next token. Restoring m blocks gives rows 0..mB - 2 and
the features of row mB - 1: exactly what the skipped prefill would have given the head.

Entries are found by the hashes the scheduler gives a sequence's blocks (`Sequence.block_hashes`:
the matched ones at admission, then each as it fills) and kept least recently used first out,
at most `capacity` (the base cache's block count: a block the base can still hand out has its
entry unless it was evicted here first; a missing entry only means no drafts for that sequence).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["HeadBlockStore"]


class HeadBlockStore:
    """Head rows of whole prefix blocks, by block hash (module docstring)."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor, feat: torch.Tensor) -> None:
        """Keep a block's rows (k, v [rows, KV, hd]) and its last position's features [3D]."""
        self._entries[block_hash] = (k.clone(), v.clone(), feat.clone())
        self._entries.move_to_end(block_hash)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def restore(self, hashes: list[bytes], cached: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a sequence whose first `cached` tokens (whole blocks, their hashes leading `hashes`)
        the base skipped: the keys and values of head rows 0..cached - 2 and the features of
        position cached - 1, or None where an entry is missing."""
        m = cached // self.block_size
        if cached <= 0 or cached % self.block_size or len(hashes) < m:
            return None
        found = []
        for h in hashes[:m]:
            entry = self._entries.get(h)
            if entry is None:
                return None
            self._entries.move_to_end(h)
            found.append(entry)
        return torch.cat([e[0] for e in found]), torch.cat([e[1] for e in found]), found[-1][2]

    def file(self, hashes: list[bytes], k: torch.Tensor, v: torch.Tensor, positions: list[int],
             feats: torch.Tensor) -> None:
        """After a catch-up that computed the head rows at `positions` (their features `feats`
        [m, 3D]; k / v: the sequence's head cache, valid past them): an entry for each block whose
        last position is among them and whose hash `hashes` (the sequence's) holds."""
        B = self.block_size
        for i, q in enumerate(positions):
            b = q // B
            if (q + 1) % B == 0 and b < len(hashes):
                lo = max(b * B - 1, 0)
                self.put(hashes[b], k[lo:q], v[lo:q], feats[i])
