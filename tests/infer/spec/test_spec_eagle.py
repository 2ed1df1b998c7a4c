"""EAGLE-3 heads: the published layout (config keys, tensor names, d2t / t2d), the head's cache
kept by the proposer against a from-scratch recompute, drafts against a from-scratch chain,
greedy output identical to plain decoding (chains, trees, batches), sampling lossless
(chi-square against the exact target distribution), the training-time test against inference,
training that lowers the loss and resumes, the head quantized on its own."""

import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.eagle import EagleProposer, load_eagle3_for_inference
from quantspec.infer.spec.tree import TreeSpec, depths
from quantspec.kernels.cpu import cpu_kernels
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3 import (Eagle3Args, causal_attend, default_aux_layers,
                                        eagle3_weight_table, load_eagle3, save_eagle3)
from quantspec.model_zoo.eagle3_train import (Eagle3TrainConfig, choose_eagle3_vocab, eagle3_rows, init_eagle3,
                                              train_eagle3, ttt_outputs)
from quantspec.model_zoo.llama import DenseCausalAttention, ModelArgs

torch.set_num_threads(1)
AUX = (0, 1, 2)  # the tiny Llama has 2 layers: its embeddings, layer 1's input, the last output


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


@pytest.fixture(scope="module")
def head_dir(base, tmp_path_factory):
    """A head for the tiny Llama: the recipe's initialisation with noise on the layer."""
    head = init_eagle3(base, torch.arange(0, 512, 2), AUX)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.midlayer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return save_eagle3(head, tmp_path_factory.mktemp("eagle3") / "head")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _run(model, prompts, proposer=None, k=0, params=None, chunk=None, first_index=0):
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=len(prompts), max_length=160,
                                     spec_max_draft_tokens=k, prefill_chunk=chunk), eos_token_ids=[], proposer=proposer)
    seqs = [eng.add_request(p, params or SamplingParams(max_new_tokens=40), request_index=first_index + i)
            for i, p in enumerate(prompts)]
    eng.run()
    return seqs


def test_published_layout(head_dir, base):
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 256 and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(AUX), "use_aux_hidden_state": True}
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == 64
    from safetensors.torch import load_file

    tensors = load_file(str(head_dir / "model.safetensors"))
    assert set(tensors) == set(eagle3_weight_table(Eagle3Args.from_config(cfg)))
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # [embedding ; hidden]
    assert tensors["lm_head.weight"].shape == (256, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(256) + tensors["d2t"], torch.arange(0, 512, 2))  # target = d + d2t[d]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), torch.arange(0, 512, 2))
    assert default_aux_layers(30) == (2, 15, 27)
    # on the default layers no ids are written: both engines then capture (2, L // 2, L - 3)
    big = ModelArgs(hidden_size=64, intermediate_size=128, num_layers=30, num_heads=4, num_kv_heads=2, vocab_size=512)
    default = Eagle3Args.for_base(big, 100, (2, 15, 27)).to_config()
    assert default["eagle_config"] == {"use_aux_hidden_state": True}
    assert Eagle3Args.from_config(default).aux_layers(30) == (2, 15, 27)
    head = load_eagle3(head_dir, base.args)
    assert head.args.aux_layer_ids == AUX and head.args.draft_vocab_size == 256


def _reference_rows(base, head, tokens):
    """From scratch: the base's aux features over `tokens`, the head over every row causally →
    (the rows' inputs (tokens, hidden [L-1, D], positions), outputs [L-1, D], keys [L-1, KV, hd])."""
    ids = torch.tensor(tokens)
    _, streams = base(ids, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)), capture=head.args.aux_layer_ids)
    feats = torch.cat(streams, dim=-1)
    keys = []

    def attend(q, k, v):
        keys.append(k)
        return causal_attend(q, k, v)

    n = len(tokens) - 1
    inputs = (ids[1:], head.fc(feats[:n]), torch.arange(n))
    return inputs, head(*inputs, attend), keys[0]


class AuxCapture:
    """The reference of `capture`: forward (pre-)hooks on the base's decoder layers that keep the
    residual streams of the latest forward, `features()` → [T, 3·D] in id order."""

    def __init__(self, base, layer_ids: tuple[int, ...]):
        layers = base.model.layers
        self.ids = tuple(layer_ids)
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = []
        for i in sorted(set(self.ids)):
            if i < len(layers):
                self._handles.append(layers[i].register_forward_pre_hook(self._pre(i)))
            else:  # id L: the last layer's output
                self._handles.append(layers[i - 1].register_forward_hook(self._post(i)))

    def _pre(self, i):
        return lambda _m, args: self._seen.__setitem__(i, args[0])

    def _post(self, i):
        return lambda _m, _args, out: self._seen.__setitem__(i, out)

    def features(self) -> torch.Tensor:
        return torch.cat([self._seen[i] for i in self.ids], dim=-1)  # [T, 3D]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@pytest.mark.parametrize("ids", [AUX, (2, 0), (1,)])
def test_forward_capture_equals_the_hooks(base, ids):
    """`Transformer.forward(capture=ids)` gives the streams forward hooks (`AuxCapture`)
    see, in `ids`' order; id L is the last layer's output over every row, whatever `out_rows`."""
    tokens = torch.tensor(_prompts([11], seed=4)[0])
    attn = DenseCausalAttention(1, len(tokens))
    cap = AuxCapture(base, ids)
    try:
        with torch.no_grad():
            hidden = base(tokens, torch.arange(len(tokens)), attn)
            want = cap.features()
    finally:
        cap.remove()
    with torch.no_grad():
        out, streams = base(tokens, torch.arange(len(tokens)), attn, torch.tensor([10, 3]), capture=ids)
    assert torch.equal(torch.cat(streams, dim=-1), want) and torch.equal(out, hidden[[10, 3]])
    with pytest.raises(QuantSpecError, match="capture ids"):
        base(tokens, torch.arange(len(tokens)), attn, capture=(3,))


def _reference_chain(head, inputs, out, depth):
    """Top-1 drafts from scratch: each depth runs the head over the context rows and the chain
    so far (a draft row reads the previous row's output and the previous draft)."""
    toks, hidden, pos = inputs
    h, chain = out[-1], []
    for d in range(depth):
        chain.append(int(head.target_ids(head.logits(h[None]).argmax(-1))[0]))
        if d + 1 == depth:
            break
        hidden = torch.cat([hidden, h[None]])
        toks = torch.cat([toks, torch.tensor(chain[-1:])])
        pos = torch.cat([pos, pos[-1:] + 1])
        h = head(toks, hidden, pos, causal_attend)[-1]
    return chain


class _Oracle(EagleProposer):
    """Drafts the plain run's tokens: a chain wrong at depth 3; a tree whose depth-2 true token is
    the second sibling (an accepted path through a non-first row). Keeps each sequence's head
    state at its end and the head's own drafts, to compare with recomputes."""

    def __init__(self, *a, plain, **k):
        super().__init__(*a, **k)
        self.plain, self.kept, self.drafted = plain, {}, []

    def _catch_up(self, seq, st):
        self._current = (seq.seq_id, len(seq.output_ids))
        return super()._catch_up(seq, st)

    def _draft(self, st, depth):
        self.drafted.append((st.n, st.last.clone(), super()._draft(st, depth)))
        sid, done = self._current
        out = []
        for d in range(depth):
            t = self.plain[sid][min(done + d, len(self.plain[sid]) - 1)]
            wrong = (t + 7) % 500
            out.append([wrong if d == 2 else t] if self.width == 1 else [wrong, t] if d == 1 else [t, wrong])
        return out

    def release(self, seq):
        st = self._states.get(seq.seq_id)
        if st is not None:
            self.kept[seq.seq_id] = (list(seq.tokens), st.n, st.k[:st.n].clone(), st.last.clone())
        super().release(seq)


@pytest.mark.parametrize("tree,chunk", [(None, None), (TreeSpec(3, 2), None), (None, 5)])
def test_head_cache_equals_a_recompute_with_accepted_drafts(base, head_dir, tree, chunk):
    prompts = _prompts([7, 19], seed=1)
    plain = {i: s.output_ids for i, s in enumerate(_run(base, prompts, chunk=chunk))}
    head = load_eagle3_for_inference(head_dir, base)
    proposer = _Oracle(head, tree=tree, max_draft_tokens=3, plain=plain)
    seqs = _run(base, prompts, proposer, proposer.max_rows, chunk=chunk)
    assert [s.output_ids for s in seqs] == [plain[0], plain[1]]
    assert sum(s.stats.accepted for s in seqs) >= 20  # accepted drafts' rows went through the head
    with torch.inference_mode():
        for seq in seqs:
            tokens, n, k, last = proposer.kept[seq.seq_id]
            assert n >= len(tokens) - 5
            _, out, keys = _reference_rows(base, head, tokens[:n + 1])
            torch.testing.assert_close(k, keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(last, out[n - 1], atol=1e-5, rtol=1e-5)


def test_forwards_of_the_base_by_another_engine_are_not_filed(base, head_dir):
    """A plain engine on the same base runs between the EAGLE engine's steps: the head's cache
    still equals a recompute of the EAGLE sequence alone (only its own engine's forwards
    capture features)."""
    prompts = _prompts([8], seed=8)
    plain = {0: _run(base, prompts)[0].output_ids}
    proposer = _Oracle(load_eagle3_for_inference(head_dir, base), max_draft_tokens=3, plain=plain)
    eng = Engine(base, EngineConfig(block_size=16, max_batch_size=1, max_length=160, spec_max_draft_tokens=3),
                 eos_token_ids=[], proposer=proposer)
    seq = eng.add_request(prompts[0], SamplingParams(max_new_tokens=40))
    while eng.has_work():
        eng.step()
        _run(base, _prompts([5, 6, 7, 9], seed=9 + len(seq.output_ids)))  # decode rows: 4, as the EAGLE step's
    assert seq.output_ids == plain[0] and seq.stats.accepted > 5
    tokens, n, k, last = proposer.kept[seq.seq_id]
    with torch.inference_mode():
        _, out, keys = _reference_rows(base, proposer.head, tokens[:n + 1])
    torch.testing.assert_close(k, keys, atol=1e-5, rtol=1e-5)


def test_drafts_equal_a_from_scratch_chain(base, head_dir):
    prompts = _prompts([9], seed=2)
    plain = {0: _run(base, prompts)[0].output_ids}
    proposer = _Oracle(load_eagle3_for_inference(head_dir, base), max_draft_tokens=3, plain=plain)
    tokens = _run(base, prompts, proposer, 3)[0].tokens
    head = proposer.head
    with torch.inference_mode():
        for n, last, drafts in proposer.drafted[::3]:
            inputs, out, _ = _reference_rows(base, head, tokens[:n + 1])
            torch.testing.assert_close(last, out[-1], atol=1e-5, rtol=1e-5)
            assert [c[0] for c in drafts] == _reference_chain(head, inputs, out, len(drafts))


@pytest.mark.parametrize("tree", [None, TreeSpec(2, 2), TreeSpec(4, 3)])
def test_greedy_identical_to_plain(base, head_dir, tree):
    prompts = _prompts([7, 21, 3], seed=3)
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = EagleProposer(load_eagle3_for_inference(head_dir, base), tree=tree, max_draft_tokens=3)
    seqs = _run(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def _reference_dynamic(head, inputs, out, depth, K, N):
    """A `DxK:N` tree from scratch: each expanded node's output recomputed over the context rows
    and its own path (causal), candidates ranked by their path log-probability → (target ids,
    parent rows) as the proposer lists them."""
    toks, hidden, pos = inputs

    def output(path):  # path: [(token, hidden that proposed it)] from depth 1
        t = torch.cat([toks, torch.tensor([tk for tk, _ in path])])
        h = torch.cat([hidden, torch.stack([hp for _, hp in path])])
        p = torch.cat([pos, pos[-1] + 1 + torch.arange(len(path))])
        return head(t, h, p, causal_attend)[-1]

    def children(h, parent, score, level, path):
        lp = torch.log_softmax(head.logits(h[None])[0], dim=-1).topk(K)
        ids = head.target_ids(lp.indices).tolist()
        return [dict(score=score + float(v), tok=t, parent=parent, level=level, path=path + [(t, h)])
                for v, t in zip(lp.values, ids)]

    nodes = children(out[-1], -1, 0.0, 1, [])
    frontier = list(range(K))
    for d in range(1, depth):
        beam = sorted(frontier, key=lambda i: -nodes[i]["score"])[:K]
        frontier = []
        for i in beam:
            kids = children(output(nodes[i]["path"]), i, nodes[i]["score"], d + 1, nodes[i]["path"])
            frontier += range(len(nodes), len(nodes) + len(kids))
            nodes += kids
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i]["score"], nodes[i]["level"], i))[:N]
    rank = {i: r for r, i in enumerate(order, start=1)}
    return [nodes[i]["tok"] for i in order], [0 if nodes[i]["parent"] < 0 else rank[nodes[i]["parent"]]
                                              for i in order]


class _RecordedDynamic(EagleProposer):
    """Keeps (cache rows, the newest output, the tree) of every dynamic draft."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.drafted = []

    def _draft_dynamic(self, st, depth):
        tree = super()._draft_dynamic(st, depth)
        self.drafted.append((st.n, st.last.clone(), depth, tree))
        return tree


def test_dynamic_tree_min_confidence_stops_growing_below_it(base, head_dir):
    """A gated dynamic tree has a node at depth d + 1 only where depth d's best path probability
    is at least the threshold, and some trees stop early; greedy output stays plain decoding's."""
    prompts = _prompts([7, 21, 3], seed=5)
    plain = [s.output_ids for s in _run(base, prompts)]
    tree = TreeSpec(4, 3, 8)
    free = _RecordedDynamic(load_eagle3_for_inference(head_dir, base), tree=tree)
    _run(base, prompts, free, free.max_rows)
    best = sorted(max(p) for *_, (_, _, p) in free.drafted)
    tau = best[len(best) // 2]  # the median first-depth best: about half the trees stop there
    gated = _RecordedDynamic(load_eagle3_for_inference(head_dir, base), tree=tree, min_confidence=tau)
    seqs = _run(base, prompts, gated, gated.max_rows)
    assert [s.output_ids for s in seqs] == plain
    stopped = 0
    for *_, depth, (ids, parents, probs) in gated.drafted:
        level = depths(parents)[1:]
        for d in range(1, max(level)):
            assert max(p for p, l in zip(probs, level) if l == d) >= tau
        top = max(level)
        stopped += top < depth and max(p for p, l in zip(probs, level) if l == top) < tau
    assert stopped > 0


@pytest.mark.parametrize("tree", [TreeSpec(3, 2, 4), TreeSpec(4, 3, 8)])
def test_dynamic_tree_equals_a_from_scratch_search_and_greedy_is_plain(base, head_dir, tree):
    """`DxK:N`: each depth's K best nodes run through the head in one forward, each attending to
    the sequence and its own ancestors only; the tree equals a search that recomputes every
    node's output from scratch; every prefix is a tree, best path first; greedy output is plain
    decoding's."""
    prompts = _prompts([7, 21, 3], seed=6)
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = _RecordedDynamic(load_eagle3_for_inference(head_dir, base), tree=tree)
    assert proposer.max_rows == tree.nodes
    seqs = _run(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0
    (prompt,) = _prompts([9], seed=7)
    proposer = _RecordedDynamic(load_eagle3_for_inference(head_dir, base), tree=tree)
    tokens = _run(base, [prompt], proposer, proposer.max_rows)[0].tokens
    head = proposer.head
    with torch.inference_mode():
        assert len(proposer.drafted) > 4 and proposer.drafted[0][2] == tree.depth
        for n, last, depth, (ids, parents, _) in proposer.drafted[::4]:
            K = tree.width  # a step near the end drafts fewer depths
            assert len(ids) == min(tree.nodes, K + (depth - 1) * K * K)
            assert all(p <= j for j, p in enumerate(parents))
            inputs, out, _ = _reference_rows(base, head, tokens[:n + 1])
            torch.testing.assert_close(last, out[-1], atol=1e-5, rtol=1e-5)
            assert (ids, parents) == _reference_dynamic(head, inputs, out, depth, tree.width, tree.nodes)


class _Gated(EagleProposer):
    """Records, per `_draft` call, the top-1 probability of every depth the head computed (its
    softmax over the draft vocabulary) and the candidates drafted."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls, real = [], self.head.logits

        def logits(h):
            out = real(h)
            self.calls[-1][0].append(float(torch.softmax(out.float(), -1).amax()))
            return out

        self.head.logits = logits

    def _draft(self, st, depth):
        self.calls.append(([], depth))
        cands = super()._draft(st, depth)
        self.calls[-1] = (*self.calls[-1], cands)
        return cands


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 2)])
def test_min_confidence_stops_at_the_first_unsure_depth(base, head_dir, tree):
    """With `min_confidence` a chain drafts the depths before the first whose top-1 probability
    is below it (none when the first is); a tree always drafts its first depth's candidates and
    stops at the first deeper depth below it. Greedy output stays plain decoding's."""
    prompts = _prompts([7, 21, 3], seed=5)
    plain = [s.output_ids for s in _run(base, prompts)]
    free = _Gated(load_eagle3_for_inference(head_dir, base), tree=tree, max_draft_tokens=3)
    _run(base, prompts, free, free.max_rows)
    tau = sorted(p for probs, _, _ in free.calls for p in probs)[len(free.calls)]  # some depths fall below
    gated = _Gated(load_eagle3_for_inference(head_dir, base), tree=tree, max_draft_tokens=3, min_confidence=tau)
    seqs = _run(base, prompts, gated, gated.max_rows)
    assert [s.output_ids for s in seqs] == plain
    stopped = 0
    for probs, depth, cands in gated.calls:
        first = 1 if tree is not None else 0  # a tree's first depth is never stopped
        sure = next((d for d, p in enumerate(probs) if d >= first and p < tau), depth)
        assert len(cands) == sure, (probs, tau, cands)
        assert len(probs) == min(depth, sure + 1)  # no depth computed past the first unsure one
        stopped += sure < depth
    assert stopped > 0
    with pytest.raises(QuantSpecError, match="must be in"):
        EagleProposer(gated.head, min_confidence=1.0)


def test_build_proposer_with_backoff_and_cli_config(base, head_dir):
    from types import SimpleNamespace

    from quantspec.infer.predictor import InferConfig
    from quantspec.infer.spec.proposers import build_proposer

    loaded = SimpleNamespace(model=base)
    cfg = InferConfig(speculate_method="eagle", draft_model=str(head_dir), speculate_max_draft_token_num=4)
    proposer, k = build_proposer(cfg, loaded)
    assert k == 4 and proposer.policy is not None
    prompts = _prompts([5, 12], seed=4)
    plain = [s.output_ids for s in _run(base, prompts)]
    assert [s.output_ids for s in _run(base, prompts, proposer, k)] == plain
    tree, rows = build_proposer(InferConfig(speculate_method="eagle", draft_model=str(head_dir),
                                            speculate_tree="3x2"), loaded)
    assert rows == 6 and tree.policy is None and tree.width == 2
    dynamic, rows = build_proposer(InferConfig(speculate_method="eagle", draft_model=str(head_dir),
                                               speculate_tree="3x2:5"), loaded)
    assert rows == 5 and dynamic.tree.dynamic
    with pytest.raises(QuantSpecError, match="--draft-model"):
        build_proposer(InferConfig(speculate_method="eagle"), loaded)


def test_sampling_is_lossless_chi_square(base, head_dir, sequence_law, pooled_chisquare):
    """The first three sampled tokens, with tree drafts from the oracle (one-hot q, many of them
    accepted) verified by rejection sampling, follow the target's exact joint distribution."""
    from test_spec_draft import _next_probs

    params = SamplingParams(decode_strategy="sampling", temperature=1.5, top_k=3, seed=7, max_new_tokens=3)
    (prompt,) = _prompts([6], seed=0)
    exact = sequence_law(_next_probs(base, params), prompt, 3)
    likely = max(exact, key=exact.get)  # the oracle drafts the likeliest continuation
    head = load_eagle3_for_inference(head_dir, base)
    n, counts, accepted = 0, {}, 0
    for rnd in range(6):
        proposer = _Oracle(head, tree=TreeSpec(2, 2), plain={i: list(likely) * 2 for i in range(128)})
        seqs = _run(base, [prompt] * 128, proposer, 4, params=params, first_index=rnd * 128)
        for s in seqs:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
            accepted += s.stats.accepted
        n += len(seqs)
    assert accepted > n // 8  # speculation really happened
    assert set(counts) <= set(exact)
    assert pooled_chisquare(counts, exact, n) > 1e-3


def test_training_time_test_is_what_drafting_computes(base, head_dir):
    """Step s, row p of the training-time test equals the s-th chain row after the context rows
    0..p, computed from scratch with the true tokens as drafts."""
    head = load_eagle3(head_dir).bind_embedding(base.model.embed_tokens)
    (tokens,) = _prompts([14], seed=5)
    rows = eagle3_rows(base, [torch.tensor(tokens)], AUX)
    with torch.inference_mode():
        outs = ttt_outputs(head, rows.tokens[0], rows.feats[0].float(), 4)
        for p, s in ((0, 1), (5, 2), (8, 3), (3, 0)):
            (toks, hidden, pos), out, _ = _reference_rows(base, head, tokens[:p + 2])
            h = out[-1]
            for j in range(1, s + 1):
                hidden, pos = torch.cat([hidden, h[None]]), torch.cat([pos, pos[-1:] + 1])
                toks = torch.cat([toks, torch.tensor([tokens[p + 1 + j]])])
                h = head(toks, hidden, pos, causal_attend)[-1]
            torch.testing.assert_close(outs[s][p], h, atol=2e-2, rtol=2e-2)  # bf16 features in training


def test_training_lowers_the_loss_and_resumes(base, tmp_path):
    seqs = [torch.tensor(s.tokens) for s in _run(base, _prompts([6] * 6, seed=6))]
    rows = eagle3_rows(base, seqs, AUX)
    vocab = choose_eagle3_vocab(rows, 128, 512, [0])
    assert 0 in vocab.tolist() and vocab.numel() == 128
    cfg = Eagle3TrainConfig(steps=12, lr=3e-3, seqs_per_step=3, save_every=6, draft_vocab_size=128, ttt_steps=3,
                          soft_targets=False)
    seen = []
    res = train_eagle3(init_eagle3(base, vocab, AUX), rows, cfg, tmp_path / "h",
                       on_step=lambda step, total, loss, acc: seen.append((step, len(acc))))
    assert res["loss_last"] < res["loss_first"] and seen[-1] == (12, 3)
    with pytest.raises(QuantSpecError, match="--resume"):
        train_eagle3(init_eagle3(base, vocab, AUX), rows, cfg, tmp_path / "h")
    more = train_eagle3(init_eagle3(base, vocab, AUX), rows, Eagle3TrainConfig(
        steps=14, lr=3e-3, seqs_per_step=3, save_every=6, draft_vocab_size=128, ttt_steps=3, soft_targets=False),
        tmp_path / "h", resume=True)
    assert more["start_step"] == 12 and len(more["losses"]) == 2
    assert load_eagle3(tmp_path / "h", base.args).args.draft_vocab_size == 128


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4"])
@pytest.mark.parametrize("target", ["portable", "quantspec"])
def test_quantized_head_drafts_the_same_and_stays_lossless(base, head_dir, tmp_path, quant_type, target):
    """The head quantized on its own: by default (portable: what vLLM and SGLang load) fc stays
    float and the decoder layer's Linears are quantized, with --target quantspec fc too; either
    way quantspec loads it and greedy output equals plain decoding."""
    from torch import nn

    from quantspec import api
    from quantspec.infer.quant_linear import QuantLinear

    # int4 at the default group size 128: K = 64 / 192 take 64, written for the engines' names too
    out = api.quantize(str(head_dir), quant_type, tmp_path / "q", **({} if target == "portable" else {"target": target}))
    head = load_eagle3_for_inference(out, base)
    assert isinstance(head.midlayer.mlp.down_proj, QuantLinear) and isinstance(head.midlayer.self_attn.q_proj, QuantLinear)
    assert isinstance(head.fc, QuantLinear) == (target == "quantspec")
    assert type(head.lm_head) is nn.Linear
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    engines = api.inspect(out)["engines"]
    assert engines["quantspec"]["status"] == "loads"
    assert engines["transformers"]["status"] == "refused"
    assert engines["vllm"]["status"] == "loads"
    assert engines["sglang"]["status"] == ("loads" if target == "portable" else "refused")
    prompts = _prompts([12], seed=7)
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = EagleProposer(head, tree=TreeSpec(2, 2))
    assert [s.output_ids for s in _run(base, prompts, proposer, proposer.max_rows)] == plain


def test_quantize_cli_eagle3_head_default_target(head_dir, tmp_path):
    """`quantspec quantize --model HEAD` needs no --target; `inspect` shows the verdicts."""
    from click.testing import CliRunner

    from quantspec.cli import main

    r = CliRunner().invoke(main, ["quantize", "--model", str(head_dir), "--quant-type", "weight_only_int8",
                                  "--out", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "no model class for an EAGLE-3 head" in text and "re:^(fc|model\\.fc)$" in text


def test_train_draft_head_eagle3_end_to_end_and_resume(tiny_llama_dir, base, tmp_path):
    from quantspec import api

    said = []
    kw = dict(chat_prompts=["Tell me about the sea.", "What is two plus two?"], max_new_tokens=12,
              aux_layer_ids=[0, 1, 2], draft_vocab_size=64, save_every=2, batch_size=2, seq_len=32)
    res = api.train_draft_head("eagle3", str(tiny_llama_dir), tmp_path / "h", steps=2, on_status=said.append, **kw)
    assert res["steps"] == 2 and res["positions"] > 2 * 12 and res["kind"] == "eagle3"
    head = load_eagle3(tmp_path / "h", base.args)
    assert head.args.aux_layer_ids == AUX and head.args.draft_vocab_size == 64
    more = api.train_draft_head("eagle3", str(tiny_llama_dir), tmp_path / "h", steps=3, resume=True,
                                on_status=said.append, **kw)
    assert more["start_step"] == 2 and len(more["losses"]) == 1
    assert any("reusing" in m for m in said)  # the second run takes the saved rows


@pytest.mark.parametrize("tree, prefix", [(None, False), ("3x2", False), (None, True)])
def test_cli_infer_eagle_equals_plain(tiny_llama_dir, head_dir, tmp_path, tree, prefix):
    from test_spec_cli import ROWS, _infer

    data = tmp_path / "in.jsonl"
    rows = ROWS if not prefix else [ROWS[0] + " " + r for r in ROWS]  # with prefix caching: a shared preamble
    data.write_text("".join(json.dumps({"src": s}) + "\n" for s in rows))
    plain, _ = _infer(tmp_path, tiny_llama_dir, data)
    extra = ["--speculate-method", "eagle", "--draft-model", head_dir, "--speculate-max-draft-token-num", 3,
             *(["--speculate-tree", tree] if tree else []),
             *(["--enable-prefix-caching", "--block-size", 16] if prefix else [])]
    spec, stats = _infer(tmp_path, tiny_llama_dir, data, *extra, tag="eagle")
    assert spec == plain
    assert stats["speculate_method"] == "eagle" and stats["drafted_tokens"] > 0
    assert (stats.get("cached_prompt_tokens", 0) > 0) == prefix


@pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")
def test_built_proposer_drafts_with_the_head_the_backend_prepared(base, head_dir):
    """On CPU the builder hands the head to the backend (`backend.prepare_head`): every linear
    packed, gate/up stacked, norms / rotary / activation on the kernels; it still drafts, and
    greedy output stays plain decoding's."""
    from types import SimpleNamespace

    from torch import nn

    from quantspec.infer.cpu.layers import CpuRMSNorm, CpuRotary, CpuSiluAndMul
    from quantspec.infer.cpu.linears import PackedLinear
    from quantspec.infer.predictor import InferConfig
    from quantspec.infer.spec.proposers import build_proposer

    cfg = InferConfig(speculate_method="eagle", draft_model=str(head_dir), speculate_tree="2x2")
    proposer, rows = build_proposer(cfg, SimpleNamespace(model=base))
    kinds = {type(m) for m in proposer.head.modules()}
    assert PackedLinear in kinds and nn.Linear not in kinds
    assert {CpuRMSNorm, CpuRotary, CpuSiluAndMul} <= kinds
    prompts = _prompts([7, 15], seed=9)
    plain = [s.output_ids for s in _run(base, prompts)]
    seqs = _run(base, prompts, proposer, rows)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def test_prefix_cached_prompts_get_the_head_rows_of_their_cached_blocks(base, head_dir):
    """With prefix caching, a prompt that shares whole blocks with an earlier one skips their
    prefill; the head's rows for them come from the block store, equal to a from-scratch
    recompute, so the sequence drafts from its first step and stays plain decoding's."""
    shared = _prompts([37], seed=21)[0]
    prompts = [shared + tail for tail in _prompts([5, 9], seed=22)]
    plain = {i: s.output_ids for i, s in enumerate(_run(base, prompts))}
    proposer = _Oracle(load_eagle3_for_inference(head_dir, base), max_draft_tokens=3, plain=plain)
    eng = Engine(base, EngineConfig(block_size=16, max_batch_size=1, max_length=160, spec_max_draft_tokens=3,
                                    prefix_caching=True), eos_token_ids=[], proposer=proposer)
    seqs = []
    for i, p in enumerate(prompts):  # one after the other: the second finds the first's blocks
        seqs.append(eng.add_request(p, SamplingParams(max_new_tokens=40), request_index=i))
        eng.run()
    assert [s.output_ids for s in seqs] == [plain[0], plain[1]]
    second = seqs[1]
    assert second.stats.cached_tokens == 32 and len(proposer.blocks) >= 2
    assert second.stats.drafted_per_position[0] >= 10  # it drafted from its first decode step
    tokens, n, k, last = proposer.kept[second.seq_id]
    with torch.inference_mode():
        _, out, keys = _reference_rows(base, proposer.head, tokens[:n + 1])
    torch.testing.assert_close(k, keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, out[n - 1], atol=1e-5, rtol=1e-5)


def test_a_block_missing_from_the_head_store_means_no_drafts_not_wrong_ones(base, head_dir):
    shared = _prompts([40], seed=23)[0]
    prompts = [shared + tail for tail in _prompts([4, 6], seed=24)]
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = EagleProposer(load_eagle3_for_inference(head_dir, base), max_draft_tokens=3)
    eng = Engine(base, EngineConfig(block_size=16, max_batch_size=1, max_length=160, spec_max_draft_tokens=3,
                                    prefix_caching=True), eos_token_ids=[], proposer=proposer)
    first = eng.add_request(prompts[0], SamplingParams(max_new_tokens=30))
    eng.run()
    proposer.blocks = type(proposer.blocks)(16, 0)  # an empty store beside the base's cached blocks
    second = eng.add_request(prompts[1], SamplingParams(max_new_tokens=30), request_index=1)
    eng.run()
    assert [first.output_ids, second.output_ids] == [plain[0][:30], plain[1][:30]]
    assert second.stats.cached_tokens == 32 and second.stats.drafted == 0 and first.stats.drafted > 0


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 2)])
def test_penalized_greedy_with_drafts_equals_plain(base, head_dir, tree):
    """Penalties, a bias and banned words adjust each draft row as plain decoding's row after the
    drafts on its path (a tree's by its parents): the answers are plain decoding's."""
    prompts = _prompts([7, 21, 3], seed=31)
    params = SamplingParams(max_new_tokens=40, repetition_penalty=1.4, frequency_penalty=2.0, logit_bias={5: 2.0},
                            bad_words=[(prompts[1][2], prompts[1][3])], min_tokens=5)
    plain = [s.output_ids for s in _run(base, prompts, params=params)]
    proposer = EagleProposer(load_eagle3_for_inference(head_dir, base), tree=tree, max_draft_tokens=3)
    seqs = _run(base, prompts, proposer, proposer.max_rows, params=params)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0 and sum(s.stats.accepted for s in seqs) > 0
    assert plain != [s.output_ids for s in _run(base, prompts)]  # the rules changed the answers
