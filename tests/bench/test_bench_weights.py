"""``streamrl bench weights`` end to end on a small shape (its figures come from the 123M one:
docs/benchmarks/history.md, the bench weights section): the learner trains each case, every
version is published as a delta and rebuilt, and the JSON line carries one case per dtype and lr with the contract's keys."""

from __future__ import annotations

import pytest

from streamrl.cli import main
from tests.helpers import last_json_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_bench_weights_reports_each_case_bit_exact(capsys, tmp_path):
    assert main(["bench", "weights", "--model", "small", "--versions", "2", "--dtypes", "bfloat16,float32",
                 "--lrs", "1e-5", "--out", str(tmp_path)]) == 0
    summary = last_json_line(capsys.readouterr().out)
    cases = {(c["dtype"], c["lr"]): c for c in summary["cases"]}
    assert set(cases) == {("bfloat16", 1e-5), ("float32", 1e-5)}
    for case in cases.values():
        assert case["bits_different"] == 0 and case["deltas"] == 2
        assert 0 < case["delta_over_full"] < 1 and case["reconstruct_over_full_read"] > 0
    # bf16 moves far fewer bits in a step than fp32 at the same lr
    assert cases[("bfloat16", 1e-5)]["delta_over_full"] < cases[("float32", 1e-5)]["delta_over_full"] / 2
    # what --help says --out holds, and nothing it does not (no plot: the bench draws none)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.json"]
