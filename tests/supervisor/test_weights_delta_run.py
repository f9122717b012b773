"""The main job with versions published by delta (``learner.weights_delta=on``) on the real
broker, a rollout worker SIGKILLed mid-run: the run still reaches every version; every version
after the first is announced as a delta on the one before; the restarted worker, which holds no
base, rebuilds its weights from the chain's full version (kept by pruning, since every kept delta
needs it) and follows on by delta; no load fails."""

from __future__ import annotations

import time
import uuid

import pytest

from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.records import PolicyVersion
from streamrl.weights import delta
from tests.helpers import kill_stage, read_topic_sync, run_summary, start_run

pytestmark = pytest.mark.e2e

VERSIONS = 10


@pytest.mark.timeout(900)
def test_the_main_job_by_delta_survives_a_rollout_worker_killed(tmp_path, bootstrap):
    prefix = f"delta{uuid.uuid4().hex[:6]}"
    proc = start_run("--bootstrap-servers", bootstrap, f"run.out_dir={tmp_path}", f"bus.topic_prefix={prefix}",
                     f"learner.consumer_group={prefix}-learner", f"reward.group={prefix}-reward",
                     f"learner.versions={VERSIONS}", "learner.weights_delta=on", "learner.weights_full_every=100",
                     "learner.keep_weights=2", "run.restart.backoff_s=0.5", "run.timeout_s=800",
                     env={"PYTHONUNBUFFERED": "1", "STREAMRL_LOG_LEVEL": "INFO",
                          "STREAMRL_WEIGHTS_CACHE": str(tmp_path / "cache")})
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)

    def kill_mid_run() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:  # a few versions in: deltas held
            try:
                versions = [PolicyVersion.decode(m.value).version for m in read_topic_sync(Bus(cfg), "policy", timeout_s=5)]
            except LookupError:  # the run has not created its topics yet
                versions = []
            if versions and max(versions) >= 3:
                break
            time.sleep(1)
        kill_stage(proc, "rollout")

    summary, _, err = run_summary(proc, 800, kill_mid_run)
    assert summary["ended"] == "done" and summary["versions"] == VERSIONS, summary
    assert summary["restarts"] >= 1 and "restarted" in err
    assert "% of full" in err  # the status line: the last version's share of a full one
    announced = {p.version: p for p in (PolicyVersion.decode(m.value) for m in read_topic_sync(Bus(cfg), "policy"))}
    assert announced[0].delta_base is None
    assert all(announced[v].delta_base == v - 1 and announced[v].delta_full == 0 for v in range(1, VERSIONS + 1))
    weights = next(tmp_path.rglob("weights"))
    assert delta.read_manifest(weights / "v0")["kind"] == "full"  # the chain's base, kept by pruning
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("rollout-*.log"))
    assert "after the chain's full version" in logs  # the restarted worker rebuilt its base
    assert "reconstructed from 1 delta(s)" in logs  # ... and then followed by one delta at a time
    assert "cannot reconstruct" not in logs
