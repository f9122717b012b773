"""``streamrl bench soak`` (issue 68): the slopes per 1,000 versions and the bounds they are held
to, on made-up samples; and the whole command at a short length on the main job."""

from __future__ import annotations

import math

import pytest

from streamrl.bench.soak import analyse, rates, slope, stage_of
from streamrl.cli import main
from tests.helpers import last_json_line

BOUNDS = {"rss_bound_mb": 40.0, "fds_bound": 10.0, "threads_bound": 10.0, "rate_drop": 0.25}


def _samples(n: int, rss_per_version: float, rate_falls: bool = False) -> list[dict]:
    out, t = [], 0.0
    for v in range(n):
        t += 2.0 * (1 + v / n) if rate_falls else 2.0
        out.append({"t": t, "version": v, "topics": {"streamrl.rewarded": 256 * v}, "lags": {"learner": v % 7},
                    "bytes_mb": {"state_json": 0.4},
                    "procs": {"learner": {"rss_mb": 400 + rss_per_version * v + (v % 3), "fds": 30, "threads": 20,
                                          "children": 0, "children_rss_mb": 0.0},
                              "broker": {"rss_mb": 40.0, "fds": 12 + v // 400, "threads": 9, "children": 0,
                                         "children_rss_mb": 0.0}}})
    return out


def test_slopes_per_thousand_versions_and_what_counts_as_growing():
    assert slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0) and slope([1, 1], [0, 9]) == 0.0
    flat = analyse(_samples(400, 0.0), 0.25, BOUNDS)
    assert flat["grows"] == [] and flat["versions"] == 399 and flat["from_version"] == 99
    assert abs(flat["series"]["rss_mb.learner"]["slope_per_1000"]) < 1.0
    assert flat["series"]["topic_records.streamrl.rewarded"]["slope_per_1000"] == pytest.approx(256_000, rel=1e-6)
    assert flat["lag_max"] == {"learner": 6} and flat["rate_last_over_first_quarter"] == pytest.approx(1.0, abs=0.02)
    growing = analyse(_samples(400, 0.143, rate_falls=True), 0.25, BOUNDS)  # the learner's 143 MB / 1,000 of issue 68
    assert growing["series"]["rss_mb.learner"]["slope_per_1000"] == pytest.approx(143, abs=2)
    assert growing["grows"] == ["rss_mb.learner", "versions_per_s (falls)"], growing["grows"]
    assert len(rates(_samples(400, 0.0))) == 4 and rates(_samples(3, 0.0)) == []


def test_a_runs_processes_are_told_apart_by_what_they_run():
    assert stage_of(["/home/u/.calfkit/bin/tansu-v0.6.0", "broker", "--listener-url", "tcp://x"]) == "broker"
    assert stage_of(["/venv/bin/python", "-m", "streamrl", "reward", "--config", "c.yaml"]) == "reward"
    assert stage_of(["/venv/bin/python", "-c", "pass"]) == "python"


@pytest.mark.e2e
@pytest.mark.timeout(600)  # 240 s on a machine as slow as CI's last
def test_the_soak_bench_samples_the_main_job_and_computes_its_slopes(tmp_path, capsys):
    """The command on the main job, a few versions: every stage sampled, the topics' records
    counted exactly (~256 rewarded a version), the learner's checkpoint state small."""
    rc = main(["bench", "soak", "--versions", "6", "--sample-s", "1", "--skip", "0", "--out", str(tmp_path),
               "run.warm_start_steps=5"])
    assert rc == 0
    res = last_json_line(capsys.readouterr().out)["this"]
    assert res["returncode"] == 0 and res["versions"] == 6 and res["samples"] >= 4, res
    series = res["series"]
    for stage in ("supervisor", "broker", "learner", "feed", "archive", "reward#0", "reward#1", "rollout#0"):
        if stage == "feed" and "rss_mb.feed" not in series:
            continue  # the feed publishes its prompts and ends: it may be gone before the second sample
        for what in ("rss_mb", "fds", "threads"):
            assert math.isfinite(series[f"{what}.{stage}"]["slope_per_1000"]), (what, stage)
        assert series[f"rss_mb.{stage}"]["max"] > 1.0
    rewarded = series["topic_records.streamrl.rewarded"]["slope_per_1000"]
    assert 100_000 < rewarded < 600_000, rewarded  # 256 records a version, read at sampling times
    assert {"learner", "archive", "rollout-0"} <= set(res["lag_max"])
    assert series["bytes_mb.state_json"]["max"] < 1.0  # the de-duplication window: a few versions' ids
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
