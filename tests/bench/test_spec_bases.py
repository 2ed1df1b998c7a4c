"""`bench/spec_bases.py`: n-gram speculation on a quantized base of the default model runs, its
output equal to that base's plain greedy output (the bench refuses to print otherwise)."""

import pytest

pytestmark = pytest.mark.bench


def test_bad_rounds_are_refused(spec_bases):
    with pytest.raises(SystemExit, match="--rounds 0"):
        spec_bases.main(["--rounds", "0"])


def test_an_unknown_base_is_one_line(spec_bases):
    with pytest.raises(SystemExit, match="'weight_only_int9': unknown --quant-type 'weight_only_int9'; use one of"):
        spec_bases.main(["--bases", "weight_only_int9"])
    with pytest.raises(SystemExit, match="unknown recipe part 'g7x'"):
        spec_bases.main(["--bases", "weight_only_int4@g7x"])


@pytest.mark.slow
def test_one_prompt_on_the_int8_base(spec_bases, capsys):
    out = spec_bases.main(["--bases", "weight_only_int8", "--prompts", "1", "--rounds", "2", "--new-tokens", "24"])
    rows = {(r["base"], r["prompts"]): r for r in out["rows"]}
    assert {b for b, _ in rows} == {"fp32", "weight_only_int8"}
    for r in out["rows"]:
        assert r["plain_tps"] > 0 and r["ngram_tps"] > 0 and 0 < r["prefill_share"] < 1
        assert len(r["round_ratios"]) == 2 and min(r["round_ratios"]) > 0
    printed = capsys.readouterr().out
    assert "| weight_only_int8 | all code |" in printed and "(median " in printed
