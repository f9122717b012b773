"""``streamrl bench ablation`` on a CI-sized workload, through the CLI as a user runs it: the four
schedules of verl's reward-agent ablation over the same rollouts and updates. Only what must hold
whatever the machine's load is asserted: the synchronous loop is the slowest, every mode made the
same updates on the same rewards, the off-policy modes trained one step stale, and the output's
shape (the JSON line last, the PNG)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.bench.ablation import MODES, remote_gsm8k_score
from tests.helpers import gsm8k_path, last_json_line


def test_remote_score_blocks_and_scores_gsm8k():
    import time

    started = time.monotonic()
    out = remote_gsm8k_score("gsm8k", "so it is 72\n#### 72", "72", {"index": 3, "sample": 1},
                             latency=40.0, min_latency=1.0, scale=0.001)
    took = time.monotonic() - started
    assert out["score"] == 1.0
    assert 0.001 <= took < 1.0  # uniform on [1, 40] ms at this scale, plus scheduling
    assert remote_gsm8k_score("gsm8k", "#### 71", "72", {"index": 3, "sample": 1}, scale=0.0)["score"] == 0.0


@pytest.mark.e2e
def test_bench_ablation_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "streamrl", "bench", "ablation", "--quick", "--out", str(tmp_path),
                           "--dataset", str(gsm8k_path("train"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = last_json_line(proc.stdout)

    assert set(res["seconds"]) == set(MODES)
    assert set(res["reduction"]) == {"pipeline_only", "off_policy_only", "both"}
    assert all(isinstance(v, float) and v > 0 for v in res["seconds"].values())
    sync = res["seconds"]["sync"]
    for mode, r in res["reduction"].items():
        assert math.isclose(r, 1 - res["seconds"][mode] / sync, abs_tol=1e-3), mode
    # the one ordering that must hold: the synchronous loop is the slowest
    assert max(res["seconds"], key=res["seconds"].get) == "sync"
    assert all(r > 0 for r in res["reduction"].values())

    # the same work in every mode: the same updates over the same rewards
    w = res["workload"]
    assert set(res["updates"].values()) == {w["steps"] * w["mini_batches"]}
    assert set(res["records_scored"].values()) == {w["steps"] * w["prompts"] * w["group_size"]}
    assert len(set(res["reward_mean"].values())) == 1
    # on-policy modes train on fresh batches, one-step off-policy ones on batches one step old
    assert res["max_staleness"] == {"sync": 0, "pipeline_only": 0, "off_policy_only": 1, "both": 1}

    png = Path(res["plot"])
    assert png == tmp_path / "ablation.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "ablation.json").read_text())["seconds"] == res["seconds"]
