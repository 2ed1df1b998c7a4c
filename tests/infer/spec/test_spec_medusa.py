"""Medusa heads: the published layout (names, config keys), the training targets on literal rows,
a few resumable training steps, drafting chains and trees through the engine with greedy output
identical to plain decoding, and the heads quantized on their own (weight_only_int8 / int4)."""

import json

import pytest
import torch

from quantspec.errors import QuantSpecError
from quantspec.infer.engine import Engine, EngineConfig
from quantspec.infer.sampler import SamplingParams
from quantspec.infer.spec.medusa import MedusaProposer, load_medusa_for_inference
from quantspec.infer.spec.tree import TreeSpec
from quantspec.kernels.cpu import cpu_kernels
from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.medusa import MedusaArgs, MedusaHeads, load_medusa, medusa_weight_table, save_medusa
from quantspec.model_zoo.medusa_train import init_medusa, medusa_targets, train_medusa
from quantspec.model_zoo.mtp_train import IGNORE, MTPFeatures, MTPTrainConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


@pytest.fixture(scope="module")
def heads_dir(base, tmp_path_factory):
    """Heads for the tiny Llama with random ResBlocks (some drafts right, most wrong)."""
    heads = init_medusa(base, torch.arange(0, 512, 2), num_heads=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for head in heads.medusa_head:
            head[0].linear.weight.copy_(torch.randn(64, 64, generator=g) * 0.05)
    return save_medusa(heads, tmp_path_factory.mktemp("medusa") / "heads")


def test_published_layout(heads_dir):
    cfg = json.loads((heads_dir / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    table = medusa_weight_table(MedusaArgs(3, 1, 64, 512, 256))
    assert {"medusa_head.0.0.linear.weight", "medusa_head.0.0.linear.bias", "medusa_head.2.1.weight",
            "medusa_draft_vocab"} <= set(table)
    assert table["medusa_head.1.1.weight"] == (512, 64)
    # heads without quantspec's block: sizes from the tensors; without a draft vocabulary
    plain = MedusaHeads(MedusaArgs(2, 2, 64, 512))
    out = save_medusa(plain, heads_dir.parent / "plain")
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    loaded = load_medusa(out)
    assert loaded.args == MedusaArgs(2, 2, 64, 512) and loaded.medusa_draft_vocab is None
    # the same keys in a `medusa_config` block read alike
    (out / "config.json").write_text(json.dumps({"medusa_config": {"medusa_num_heads": 2, "medusa_num_layers": 2}}))
    blocked = load_medusa(out)
    assert blocked.args == loaded.args
    for a, b in zip(blocked.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_targets_stop_at_sequence_ends():
    tgt1 = torch.tensor([5, 6, 7, IGNORE, 8, 9, IGNORE])
    f = MTPFeatures(torch.zeros(7, 4), tgt1, tgt1, tgt1, tgt1)
    t = medusa_targets(f, 3)
    assert t[:, 0].tolist() == [5, 6, 7, IGNORE, 8, 9, IGNORE]
    assert t[:, 1].tolist() == [6, 7, IGNORE, IGNORE, 9, IGNORE, IGNORE]
    assert t[:, 2].tolist() == [7, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]


def test_training_lowers_the_loss_and_resumes(base, tmp_path):
    g = torch.Generator().manual_seed(0)
    n = 256
    f = MTPFeatures(torch.randn(n, 64, generator=g).to(torch.bfloat16), *(torch.randint(0, 512, (n,), generator=g)
                                                                          for _ in range(4)))
    f.tgt1[::32] = IGNORE
    vocab = torch.arange(512)
    heads = init_medusa(base, vocab, num_heads=2)
    cfg = MTPTrainConfig(steps=6, batch_tokens=64, lr=1e-2, save_every=3)
    res = train_medusa(heads, base, f, cfg, tmp_path / "h")
    assert res["loss_last"] < res["loss_first"]
    with pytest.raises(QuantSpecError, match="--resume"):
        train_medusa(init_medusa(base, vocab, num_heads=2), base, f, cfg, tmp_path / "h")
    more = train_medusa(init_medusa(base, vocab, num_heads=2), base, f, MTPTrainConfig(steps=8, batch_tokens=64,
                        lr=1e-2, save_every=3), tmp_path / "h", resume=True)
    assert more["start_step"] == 6 and len(more["losses"]) == 2
    assert load_medusa(tmp_path / "h").args.num_heads == 2


def _run(model, prompts, proposer=None, k=0, params=None):
    eng = Engine(model, EngineConfig(block_size=16, max_batch_size=len(prompts), max_length=160,
                                     spec_max_draft_tokens=k), eos_token_ids=[], proposer=proposer)
    seqs = [eng.add_request(p, params or SamplingParams(max_new_tokens=48), request_index=i)
            for i, p in enumerate(prompts)]
    eng.run()
    return seqs


@pytest.mark.parametrize("tree", [None, TreeSpec(2, 2), TreeSpec(3, 3)])
def test_medusa_greedy_identical_to_plain(base, heads_dir, tree):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 21)]
    plain = [s.output_ids for s in _run(base, prompts)]
    heads = load_medusa_for_inference(heads_dir, base)
    proposer = MedusaProposer(heads, base.model.norm, tree=tree, max_draft_tokens=3)
    seqs = _run(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0


@pytest.mark.parametrize("tree", [TreeSpec(3, 2, 4), TreeSpec(3, 3, 8)])
def test_dynamic_tree_is_the_n_best_paths_and_greedy_is_plain(base, heads_dir, tree):
    """`DxK:N`: the N most probable paths through the heads' top-K tokens (each head's
    probabilities from its own full projection, restricted to the draft vocabulary), against
    enumerating every path; gated, only the paths no deeper than the first depth whose best path
    probability is below the gate; greedy output is plain decoding's."""
    import itertools

    heads = load_medusa_for_inference(heads_dir, base)
    prompts = [[5, 9, 13, 200, 7, 40, 41], [300, 2, 44, 44, 8, 91, 17, 3, 120, 66, 4, 19]]
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = MedusaProposer(heads, base.model.norm, tree=tree)
    assert proposer.max_rows == tree.nodes
    seqs = _run(base, prompts, proposer, proposer.max_rows)
    assert [s.output_ids for s in seqs] == plain and sum(s.stats.drafted for s in seqs) > 0
    seq, g = seqs[0], torch.Generator().manual_seed(4)
    vocab = heads.medusa_draft_vocab
    tau = 0.05  # gated: no path deeper than the first depth whose best path probability is below it
    gated = MedusaProposer(heads, base.model.norm, tree=tree, min_confidence=tau)
    cut = 0
    with torch.inference_mode():
        for _ in range(8):
            seq.last_hidden = torch.randn(64, generator=g) * 3
            x = heads.features(base.model.norm(seq.last_hidden)[None], tree.depth)  # [D, 1, D]
            lp, ids = [], []
            for k in range(tree.depth):
                top = torch.log_softmax(heads.projections()[k](x[k])[0, vocab].float(), -1).topk(tree.width)
                lp.append(top.values.tolist())
                ids.append(vocab[top.indices].tolist())
            best_path = torch.tensor([row[0] for row in lp]).cumsum(0)
            below = (best_path < torch.tensor(tau).log()).nonzero()
            allowed = int(below[0, 0]) + 1 if below.numel() else tree.depth
            cut += allowed < tree.depth
            for p, depth in ((proposer, tree.depth), (gated, allowed)):
                proposal = p.propose([seq], [tree.depth])
                every = [q for d in range(1, depth + 1) for q in itertools.product(range(tree.width), repeat=d)]
                best = sorted(every, key=lambda q: (-sum(lp[d][c] for d, c in enumerate(q)), len(q), q))[:tree.nodes]
                rank = {q: r for r, q in enumerate(best, start=1)}
                assert proposal.draft_token_ids[0].tolist() == [ids[len(q) - 1][q[-1]] for q in best]
                assert proposal.parents_of(0) == [rank.get(q[:-1], 0) for q in best]
    assert cut > 0


class _Gated(MedusaProposer):
    """Records, per `propose` call (one sequence), each head's top-1 probability (its softmax over
    the scored columns) and the number of tokens proposed."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = []

    def _logits(self, x, k):
        scores, cols = super()._logits(x, k)
        self.calls[-1][0].append(float(torch.softmax(scores.float(), -1).amax()))
        return scores, cols

    def propose(self, seqs, budgets):
        self.calls.append(([], None))
        out = super().propose(seqs, budgets)
        self.calls[-1] = (self.calls[-1][0], len(out.draft_token_ids[0]))
        return out


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 2)])
def test_min_confidence_stops_at_the_first_unsure_head(base, heads_dir, tree):
    """With `min_confidence` a chain drafts the heads before the first whose top-1 probability is
    below it (none when the first is); a tree always drafts its first head's candidates. Greedy
    output stays plain decoding's."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 21)]
    heads = load_medusa_for_inference(heads_dir, base)
    free = _Gated(heads, base.model.norm, tree=tree, max_draft_tokens=3)
    for p in prompts:
        _run(base, [p], free, free.max_rows)
    probs = sorted(q for qs, _ in free.calls for q in qs)
    tau = probs[len(probs) // 2]
    gated = _Gated(heads, base.model.norm, tree=tree, max_draft_tokens=3, min_confidence=tau)
    width, first, stopped = tree.width if tree else 1, 1 if tree else 0, 0
    for p in prompts:
        assert _run(base, [p], gated, gated.max_rows)[0].output_ids == _run(base, [p])[0].output_ids
    for qs, n in gated.calls:
        depth = next((k for k, q in enumerate(qs) if k >= first and q < tau), len(qs))
        assert n == width * depth, (qs, tau, n)
        stopped += depth < len(qs)
    assert stopped > 0
    with pytest.raises(QuantSpecError, match="must be in"):
        MedusaProposer(heads, base.model.norm, min_confidence=-0.1)


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4"])
def test_quantized_heads_draft_and_stay_lossless(base, heads_dir, tmp_path, quant_type):
    from quantspec import api
    from quantspec.infer.quant_linear import QuantLinear

    out = api.quantize(str(heads_dir), quant_type, tmp_path / "q", target="quantspec",
                       **({"group_size": 32} if quant_type == "weight_only_int4" else {}))
    heads = load_medusa_for_inference(out, base)
    assert isinstance(heads.medusa_head[0][0].linear, QuantLinear)
    assert isinstance(heads.medusa_head[0][1], QuantLinear)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (12,), generator=g).tolist()]
    plain = [s.output_ids for s in _run(base, prompts)]
    proposer = MedusaProposer(heads, base.model.norm, tree=TreeSpec(2, 2))
    assert [s.output_ids for s in _run(base, prompts, proposer, proposer.max_rows)] == plain
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    with pytest.raises(QuantSpecError, match="--method rtn or gptq"):
        api.quantize(str(heads_dir), quant_type, tmp_path / "q2", target="quantspec", method="awq",
                     dataset=str(heads_dir / "config.json"))


def test_build_proposer_with_backoff_and_cli_config(base, heads_dir):
    """Chains get the back-off (one call of the heads per step, one head's bytes per draft),
    `speculate_backoff=False` and trees do not; greedy output stays identical either way."""
    from types import SimpleNamespace

    from quantspec.infer.predictor import InferConfig
    from quantspec.infer.spec.mtp import _DRAFT_OVERHEAD, _bytes_touched
    from quantspec.infer.spec.proposers import build_proposer

    loaded = SimpleNamespace(model=base)
    cfg = InferConfig(speculate_method="medusa", draft_model=str(heads_dir), speculate_max_draft_token_num=5)
    proposer, k = build_proposer(cfg, loaded)
    assert k == 3 and proposer.policy is not None and proposer.policy.max_draft_tokens == 3  # one draft a head
    head_bytes = (64 * 64 + 64 + 256 * 64) * 4  # a ResBlock and the draft vocabulary's rows, fp32
    cost = proposer.policy.cost
    assert cost.draft_fixed == _DRAFT_OVERHEAD
    assert cost.draft_per_token == pytest.approx(head_bytes / _bytes_touched(base, skip=base.model.embed_tokens))
    prompts = [[5, 9, 13, 200, 7], [300, 2, 44, 44, 8, 91, 17, 3, 120, 66, 4, 19]]
    plain = [s.output_ids for s in _run(base, prompts)]
    seqs = _run(base, prompts, proposer, k)
    assert [s.output_ids for s in seqs] == plain and not proposer.policy._seqs  # released
    off, _ = build_proposer(InferConfig(speculate_method="medusa", draft_model=str(heads_dir),
                                        speculate_backoff=False), loaded)
    assert off.policy is None
    assert [s.output_ids for s in _run(base, prompts, off, off.max_rows)] == plain
    tree, rows = build_proposer(InferConfig(speculate_method="medusa", draft_model=str(heads_dir),
                                            speculate_tree="2x2"), loaded)
    assert rows == 4 and tree.policy is None and tree.width == 2


def test_backoff_drafts_less_where_drafts_do_not_pay_and_runs_only_the_heads_needed(base, heads_dir):
    """The tiny heads are mostly wrong: where a call of the heads costs a third of a base step the
    chain backs off (fewer drafts than always drafting, the same output); where no acceptance
    could pay for it, it never calls the heads; a step runs only as many heads as its deepest
    chain."""
    from quantspec.infer.spec.proposers import AdaptiveDraftLength, SpecCost

    heads = load_medusa_for_inference(heads_dir, base)
    counts = []
    features = heads.features
    heads.features = lambda h, count=None: counts.append(count) or features(h, count)
    prompts = [[5, 9, 13, 200, 7, 40, 41], [300, 2, 44, 44, 8, 91, 17, 3, 120, 66, 4, 19]]
    plain = [s.output_ids for s in _run(base, prompts)]
    eager = _run(base, prompts, MedusaProposer(heads, base.model.norm, max_draft_tokens=3), 3)
    costly = AdaptiveDraftLength(3, SpecCost(verify_fixed=0.0, verify_per_token=0.05, draft_fixed=0.3))
    backed = _run(base, prompts, MedusaProposer(heads, base.model.norm, max_draft_tokens=3, policy=costly), 3)
    assert [s.output_ids for s in eager] == [s.output_ids for s in backed] == plain
    assert 0 < sum(s.stats.drafted for s in backed) < sum(s.stats.drafted for s in eager) / 2
    counts.clear()
    hopeless = AdaptiveDraftLength(3, SpecCost(verify_fixed=0.5, verify_per_token=0.05, draft_fixed=3.0))
    seqs = _run(base, prompts, MedusaProposer(heads, base.model.norm, max_draft_tokens=3, policy=hopeless), 3)
    assert [s.output_ids for s in seqs] == plain
    assert hopeless.probe_k == 0 and sum(s.stats.drafted for s in seqs) == 0 and counts == []
    seq = seqs[0]
    seq.last_hidden = base.model.norm.weight.new_ones(64)
    proposal = MedusaProposer(heads, base.model.norm, max_draft_tokens=3).propose([seq, seq], [1, 2])
    assert [len(t) for t in proposal.draft_token_ids] == [1, 2] and counts == [2]


@pytest.mark.parametrize("extra", [[], ["--no-speculate-backoff"], ["--speculate-tree", "2x2"]],
                         ids=["backoff", "no-backoff", "tree"])
def test_cli_infer_medusa_equals_plain_with_its_figures(tiny_llama_dir, heads_dir, tmp_path, extra):
    from test_spec_cli import ROWS, _infer

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"src": s}) + "\n" for s in ROWS))
    plain, _ = _infer(tmp_path, tiny_llama_dir, data)
    spec, stats = _infer(tmp_path, tiny_llama_dir, data, "--speculate-method", "medusa", "--draft-model", heads_dir,
                         *extra, tag="medusa")
    assert spec == plain
    assert stats["speculate_method"] == "medusa" and stats.get("speculate_tree") == (extra[1] if extra[1:] else None)
    assert 0 < stats["draft_steps"] <= stats["drafted_tokens"]
    assert 1 <= len(stats["acceptance_per_position"]) <= (2 if extra[1:] else 3)  # depths / one position a head
    assert stats["mean_accepted_length"] >= 1.0


@pytest.mark.skipif(cpu_kernels() is None, reason="quantspec's CPU kernels are not built here")
@pytest.mark.parametrize("tree", [None, "2x2"])
def test_built_proposer_drafts_with_heads_the_backend_prepared(base, heads_dir, tree):
    """On CPU the builder hands the heads and their gathered draft-vocabulary rows to the backend
    (`backend.prepare_head`): every linear packed; they still draft, and greedy output stays
    plain decoding's."""
    from types import SimpleNamespace

    from torch import nn

    from quantspec.infer.cpu.linears import PackedLinear
    from quantspec.infer.predictor import InferConfig
    from quantspec.infer.spec.proposers import build_proposer

    cfg = InferConfig(speculate_method="medusa", draft_model=str(heads_dir), speculate_tree=tree)
    proposer, rows = build_proposer(cfg, SimpleNamespace(model=base))
    kinds = {type(m) for m in [*proposer.heads.modules(), *proposer.rows.modules()]}
    assert PackedLinear in kinds and nn.Linear not in kinds
    assert len(proposer.rows) == proposer.depth
    assert all(type(r) is PackedLinear and r.out_features == 256 for r in proposer.rows)  # the draft vocabulary's
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 17)]
    plain = [s.output_ids for s in _run(base, prompts)]
    seqs = _run(base, prompts, proposer, rows)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0
