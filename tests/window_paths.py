"""The engine's attention paths over a model whose layers slide a window, for the tests of the
families that have one: each path must give plain decoding's tokens."""

from __future__ import annotations

import torch

from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.eagle import EagleProposer
from quantspec.infer.spec.proposers import ReferenceProposer
from quantspec.infer.spec.tree import TreeSpec
from quantspec.model_zoo.eagle3_train import init_eagle3


def random_prompts(lengths, seed) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def decode(model, prompts, *, new=24, proposer=None, k=0, chunk=None, batch=None, runtime=None) -> list[list[int]]:
    """Greedy tokens of each prompt, all in one engine (block size 8, no eos; `runtime`: a backend's)."""
    eng = Engine(model, EngineConfig(block_size=8, max_batch_size=batch or len(prompts), max_length=128,
                                     spec_max_draft_tokens=k, prefill_chunk=chunk), eos_token_ids=[],
                 proposer=proposer, runtime=runtime)
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=new), request_index=i) for i, p in enumerate(prompts)]
    eng.run()
    return [s.output_ids for s in seqs]


def assert_every_path_is_plain_decoding(model, dtype) -> None:
    """Prompts longer and shorter than the window, alone (per-sequence path) and 20 at once (past
    the per-sequence batch), prefilled in chunks, verified with n-gram chains and EAGLE-3 trees:
    the same tokens as plain decoding one prompt at a time."""
    prompts = random_prompts([4, 12, 40], seed=3)
    prompts.append((prompts[1] * 4)[:40])  # repeats: the n-gram drafter finds matches
    plain = [decode(model, [p], new=40)[0] for p in prompts]
    assert decode(model, prompts, new=40) == plain
    assert decode(model, prompts, new=40, chunk=7) == plain
    many = (prompts * 5)[:20]
    assert decode(model, many, new=40) == [plain[i % len(prompts)] for i in range(20)]
    ngram = ReferenceProposer(2, 3)
    assert decode(model, prompts, new=40, proposer=ngram, k=3) == plain
    head = init_eagle3(model, torch.arange(0, 512, 2), (0, 1, 2)).to(dtype).bind_embedding(model.model.embed_tokens)
    tree = EagleProposer(head, tree=TreeSpec(2, 2))
    assert decode(model, prompts, new=40, proposer=tree, k=tree.max_rows) == plain
