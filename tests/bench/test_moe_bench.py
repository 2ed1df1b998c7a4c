"""`bench/moe.py`: a tiny random mixture of experts decodes through transformers and quantspec
(fp32, int4) in interleaved rounds, quantspec's fp32 greedy tokens equal to transformers'."""

import pytest

pytestmark = pytest.mark.bench


def test_bad_settings_are_one_line(moe_bench):
    with pytest.raises(SystemExit):
        moe_bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        moe_bench.main(["--top-k", "5", "--experts", "4"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_tiny_moe_runs_and_matches_transformers(moe_bench, capsys, arch):
    out = moe_bench.main(["--arch", arch, "--hidden", "128", "--layers", "2", "--experts", "4", "--top-k", "2",
                          "--expert-intermediate", "64", "--prompt-tokens", "8", "--new-tokens", "8",
                          "--rounds", "2", "--quant", "int4"])
    assert out["same"] and set(out["times"]) == {"transformers fp32", "quantspec fp32", "quantspec int4"}
    assert all(len(t) == 2 and min(t) > 0 for t in out["times"].values())
    printed = capsys.readouterr().out
    assert "| quantspec int4 |" in printed and "greedy tokens == transformers': True" in printed
