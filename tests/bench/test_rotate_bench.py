"""`bench/rotate.py`: every recipe is quantized plain and rotated in one run and both are
evaluated; the ratio is of their perplexity losses."""

import math

import pytest

from quantspec.model_zoo.tiny import TINY_CORPUS

pytestmark = pytest.mark.bench


def test_recipes_run_plain_and_rotated(rotate_bench, tied_llama_dir, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text(TINY_CORPUS)
    res = rotate_bench.main(["--model", str(tied_llama_dir), "--recipes", "int4-rtn,a8w8-static,int8+kv8",
                             "--calib-data", str(text), "--heldout", str(text), "--num-samples", "4",
                             "--seq-len", "32", "--json", str(tmp_path / "out.json")])
    assert list(res["recipes"]) == ["int4-rtn", "a8w8-static", "int8+kv8"]
    for r in res["recipes"].values():
        for side in ("plain", "rotated"):
            assert math.isfinite(r[side]["perplexity"]) and r[side]["delta"] == pytest.approx(
                r[side]["perplexity"] / res["fp32_perplexity"] - 1)
        assert r["delta_ratio"] == pytest.approx(r["rotated"]["delta"] / r["plain"]["delta"])
    out = capsys.readouterr().out
    assert "| recipe | plain ppl | plain Δ | R1,R2 ppl | R1,R2 Δ | Δ ratio |" in out
    assert (tmp_path / "out.json").is_file()


def test_unknown_recipe_is_refused(rotate_bench):
    with pytest.raises(SystemExit):
        rotate_bench.main(["--recipes", "int3"])


@pytest.mark.parametrize("arm,label,turned_by,recipes", [
    (["--quip", "v"], "QuIP v", "quip v", ["int4-rtn"]),
    (["--rotate", "R1,R2,R4"], "R1,R2,R4", "R1,R2,R4", ["int4-rtn", "a8w8-static"]),  # a table calibrated with R4
])
def test_run_time_transform_arms(rotate_bench, tiny_llama_dir, tmp_path, capsys, arm, label, turned_by, recipes):
    text = tmp_path / "corpus.txt"
    text.write_text(TINY_CORPUS)
    res = rotate_bench.main(["--model", str(tiny_llama_dir), "--recipes", ",".join(recipes), *arm,
                             "--calib-data", str(text), "--heldout", str(text), "--num-samples", "4",
                             "--seq-len", "32"])
    assert res["turned_by"] == turned_by and list(res["recipes"]) == recipes
    for r in res["recipes"].values():
        assert math.isfinite(r["rotated"]["perplexity"])
    assert f"| recipe | plain ppl | plain Δ | {label} ppl | {label} Δ | Δ ratio |" in capsys.readouterr().out


def test_static_recipes_take_no_quip_transforms(rotate_bench):
    with pytest.raises(SystemExit):
        rotate_bench.main(["--recipes", "a8w8-static", "--quip", "v"])
