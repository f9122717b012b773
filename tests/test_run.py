"""`streamrl run`, the README's first command: the whole pipeline as processes on the embedded
broker, to its end. Ctrl-C stopping every stage with no process left behind is asserted on the
first session of ``test_lifecycle``'s resume test (one pipeline start fewer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, last_json_line

pytestmark = pytest.mark.e2e


def start_run(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "run", "configs/local.yaml", f"run.out_dir={tmp_path}",
         "run.reward_members=1", "feed.limit=200", *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_run_goes_to_its_end_reports_and_learns(tmp_path):
    """The embedded default on its generated task, reversing the digits: the reward of the
    records the last versions generated is well above that of the first."""
    # digits:rev, not the default's inc: 40 versions of inc climb from version 15 to 35 (run to
    # run), and one suite run ended its last five only +0.07 above its first three; rev (the
    # task `bench learning` trains) climbs from ~10 and ends 40 versions at 0.5-0.8 in process
    proc = start_run(tmp_path, "learner.versions=40", "feed.limit=800", "feed.dataset=digits:rev")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    summary = last_json_line(out)  # the last line is one JSON object
    assert summary["ended"] == "done" and summary["versions"] == 40
    assert "warm start (" in err and (Path(summary["out"]) / "warm_start" / "config.json").exists()
    by_version = [r for _, r in sorted((int(v), r) for v, r in summary["reward_by_version"].items())]
    first, last = sum(by_version[:3]) / 3, sum(by_version[-5:]) / 5
    assert first <= 0.2 and last >= first + 0.15, by_version
    assert {"reward_first", "reward_last", "records", "deadletters", "plot"} <= summary.keys()
    records = summary["records"]
    assert records["prompts"] == 800
    assert 0 < records["trained"] <= records["rewarded"] <= records["rollouts"]
    # on-policy, and the rollout gate admits one group at a time: no group reaches the learner
    # too old (before the gate's lock, ~0.6 % of them did and were dropped)
    assert summary["deadletters"] == 0
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last"] <= 1.0
    plot = Path(summary["plot"])
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "version 40/40" in err  # the live status line
    # the rewarded records per data source, as the last line says them
    assert summary["by_data_source"]["digits"]["records"] == records["rewarded"]
    assert f"(digits: reward {summary['by_data_source']['digits']['reward']}" in err.strip().splitlines()[-1]
