"""`bench/spec_cost.py`: the verification-step cost bench runs the steps it claims to time, and its
fit recovers a known cost line."""

import math

import pytest

pytestmark = pytest.mark.bench


def test_fit_recovers_a_known_line(spec_cost):
    ratios = {0: 1.0, **{k: 1.0 + 0.3 + 0.07 * k for k in (1, 2, 4, 8)}}
    fixed, per_token, through_zero = spec_cost.fit_cost(ratios)
    assert fixed == pytest.approx(0.3) and per_token == pytest.approx(0.07)
    # with the intercept forced to 0, the slope absorbs it: sum(k * c) / sum(k^2)
    ks = (1, 2, 4, 8)
    assert through_zero == pytest.approx(sum(k * (0.3 + 0.07 * k) for k in ks) / sum(k * k for k in ks))
    fixed, per_token, through_zero = spec_cost.fit_cost({0: 1.0, 4: 1.2})  # one point: slope only through 0
    assert math.isnan(fixed) and math.isnan(per_token) and through_zero == pytest.approx(0.05)
    assert all(math.isnan(v) for v in spec_cost.fit_cost({0: 1.0}))


def test_bench_times_steps_that_verify_k_drafts(spec_cost, tiny_llama_dir, capsys):
    rounds, repeats, drafts = 2, 2, (0, 2, 5)
    res = spec_cost.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--threads", "1",
                          "--drafts", "2,5", "--rounds", str(rounds), "--repeats", str(repeats), "--context", "12"])
    assert res["drafts"] == list(drafts)  # k = 0, the baseline, is always measured
    assert sorted(res["median_s"]) == list(drafts) and all(t > 0 for t in res["median_s"].values())
    assert res["ratio_median"][0] == 1.0 and res["ratio_fastest"][0] == 1.0
    # every timed step verified its k drafts (the warm-up round and the prefills verify none)
    assert res["verified"] == rounds * repeats * sum(drafts)
    out = capsys.readouterr().out
    assert "| 5 | 6 |" in out and "verify_per_token" in out


def test_bench_refuses_bad_input(spec_cost, tmp_path):
    with pytest.raises(SystemExit, match="0..16"):
        spec_cost.main(["--drafts", "0,17"])
    with pytest.raises(SystemExit, match="comma-separated"):
        spec_cost.main(["--drafts", "2;4"])
    with pytest.raises(SystemExit, match=">= 1"):
        spec_cost.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match=">= 1"):
        spec_cost.main(["--threads", "0"])
    with pytest.raises(SystemExit, match="does not exist"):
        spec_cost.main(["--model", str(tmp_path / "missing")])


def _cpu_kernels():
    from quantspec.kernels import cpu as cg

    return cg.cpu_kernels()


@pytest.mark.skipif(_cpu_kernels() is None, reason="the greedy head (its prefetch) needs quantspec's CPU kernels")
def test_prefetch_ab_times_each_step_both_ways(spec_cost, tiny_llama_dir, capsys):
    rounds, repeats, drafts = 1, 2, (0, 9)
    res = spec_cost.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--threads", "1", "--drafts", "9",
                          "--rounds", str(rounds), "--repeats", str(repeats), "--context", "12", "--prefetch-ab"])
    # each timed step ran twice (prefetch on, then off or the other way round), each verifying its drafts
    assert res["verified"] == 2 * rounds * repeats * sum(drafts)
    assert sorted(res["prefetch_ab"]) == list(drafts)
    for k, r in res["prefetch_ab"].items():
        assert r["on_s"] > 0 and r["off_s"] > 0
        assert r["on_s"] == res["median_s"][k]  # the main table is the default: prefetch on
    assert "| 9 | 10 |" in capsys.readouterr().out.split("prefetch on vs off")[1]
