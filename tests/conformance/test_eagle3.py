"""An EAGLE-3 head written by quantspec, built and loaded by vLLM's and SGLang's own EAGLE-3 model
code (`lift_eagle3.py`): the engines size every module from its config.json as quantspec does,
their `load_weights` puts every tensor somewhere (q/k/v and gate/up into their stacked shards),
leaves only the embedding to be shared from the target, and maps the draft vocabulary to the
same target ids; their aux-layer choice agrees with quantspec's on the default layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantspec.model_zoo.checkpoint import load_model
from quantspec.model_zoo.eagle3 import default_aux_layers, save_eagle3
from quantspec.model_zoo.eagle3_train import init_eagle3

LIFT = Path(__file__).with_name("lift_eagle3.py")
AUX = (0, 1, 2)  # the conformance model has 2 layers: explicit ids


@pytest.fixture(scope="session")
def eagle3_head(conformance_model, tmp_path_factory):
    """A head for the conformance model with a draft vocabulary of every third token."""
    base = load_model(conformance_model)[0]
    head = init_eagle3(base, torch.arange(1, base.args.vocab_size, 3), AUX)
    return save_eagle3(head, tmp_path_factory.mktemp("eagle3") / "head"), head, base.args


@pytest.fixture(scope="session")
def engine_eagle3(engine_sources, eagle3_head) -> dict:
    path, _, args = eagle3_head
    out = {}
    for engine, src in engine_sources.items():
        if isinstance(src, str):
            out[engine] = src
            continue
        r = subprocess.run([sys.executable, str(LIFT), engine, str(src.source), str(path), str(args.num_layers),
                            str(args.vocab_size)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not r.stdout.strip():
            raise RuntimeError(f"lift_eagle3.py {engine} failed:\n{r.stderr[-3000:]}")
        out[engine] = json.loads(r.stdout)
    return out


def _lifted(engine_eagle3, engine):
    res = engine_eagle3[engine]
    if isinstance(res, str):
        pytest.skip(res)
    assert "fatal" not in res, res.get("fatal")
    return res


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_builds_and_loads_the_head(engine_eagle3, eagle3_head, engine):
    res = _lifted(engine_eagle3, engine)["result"]
    _, head, args = eagle3_head
    D, Vd = args.hidden_size, head.args.draft_vocab_size
    params, loads = res["params"], res["loads"]
    p = "model.layers.0."
    assert params["model.fc.weight"] == [D, 3 * D]  # three aux hidden states of the target's width
    assert params[p + "self_attn.qkv_proj.weight"][1] == 2 * D  # [embedding ; hidden]
    assert p + "hidden_norm.weight" in params and params["lm_head.weight"] == [Vd, D]
    # every parameter but the embedding comes from the head; the embedding is the target's
    assert set(loads) == set(params) - {"model.embed_tokens.weight"}
    assert res["nan_left"] == ["model.embed_tokens.weight"]
    assert sorted(s for s, _ in loads[p + "self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert sorted(s for s, _ in loads[p + "mlp.gate_up_proj.weight"]) == [0, 1]
    assert all(len(v) == 1 for k, v in loads.items() if "qkv" not in k and "gate_up" not in k)
    assert res["sample"]["model.fc.weight"] == pytest.approx(float(head.fc.weight.detach().sum()))
    targets = head.target_ids(torch.arange(Vd)).tolist()
    if engine == "vllm":  # vLLM keeps d2t as offsets: target = draft + d2t
        assert [i + d for i, d in enumerate(res["draft_id_to_target_id"])] == targets
    else:  # SGLang turns d2t into the hot token ids
        assert res["hot_token_id"] == targets


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_aux_layers(engine_eagle3, engine):
    """Both engines take quantspec's default layers (2, L // 2, L - 3) when the config names none
    (vLLM: inputs of those layers; SGLang: `layers_to_capture`, captured at their input too).
    Explicit ids are read as written by vLLM, one layer later by SGLang: why a head on the
    default layers writes none."""
    aux = _lifted(engine_eagle3, engine)["aux"]
    assert aux["default"] == list(default_aux_layers(30))
    assert aux["from_config"] == (list(AUX) if engine == "vllm" else [i + 1 for i in AUX])
