"""The local launcher's supervision on real stage processes (a reward member on the suite's
broker): a crash gives one set of events, whoever supervised (issue 57: ``failed()`` supervised
and dropped them); a stage SIGSTOPped past ``run.stage_timeout_s`` is SIGKILLed and restarted; the
loop's questions (``returncode``, ``metrics_url``) never wait on a stage."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from streamrl.config import BusConfig, RestartConfig
from streamrl.supervisor.launcher import LocalLauncher
from tests.helpers import alive, wait_for_sync


def member(launcher: LocalLauncher, bus_config: BusConfig) -> None:
    launcher.start("reward-0", ["reward", "--bootstrap-servers", bus_config.bootstrap_servers,
                                f"bus.topic_prefix={bus_config.topic_prefix}", "metrics.port=0"], "reward")


def events_until(launcher: LocalLauncher, what: str, timeout_s: float = 120) -> list[str]:
    """Every event the supervision returns until one contains ``what``."""
    seen: list[str] = []
    wait_for_sync(lambda: any(what in e for e in seen) or seen.extend(launcher.supervise()), timeout_s, what,
                  interval=0.2)
    return seen


def test_a_crash_gives_one_set_of_events_whoever_supervised(bus_config, tmp_path: Path):
    launcher = LocalLauncher(tmp_path, RestartConfig(backoff_s=0.2))
    member(launcher, bus_config)
    try:
        wait_for_sync(lambda: launcher.supervise() is not None and launcher.metrics_url("reward-0"), 120,
                      "the member's metrics")
        os.kill(launcher.pid("reward-0"), signal.SIGKILL)
        launcher.procs["reward-0"].wait()
        assert launcher.failed() is None  # a benchmark's question: it supervises, and keeps the events
        events = events_until(launcher, "restarted")
        assert events == ["reward-0: exited with -9; restarting in 0.2 s", "reward-0: restarted (1 so far)"], events
        assert launcher.restart_count() == 1
    finally:
        launcher.stop_all(timeout_s=10)


def test_a_stage_sigstopped_past_the_timeout_is_killed_and_restarted(bus_config, tmp_path: Path):
    launcher = LocalLauncher(tmp_path, RestartConfig(backoff_s=0.2), stage_timeout_s=3)
    member(launcher, bus_config)
    try:
        first = wait_for_sync(lambda: launcher.supervise() is not None and launcher.metrics_url("reward-0"), 120,
                              "the member's metrics")
        pid = launcher.pid("reward-0")
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        asked = time.monotonic()
        assert launcher.returncode("reward-0") is None and launcher.metrics_url("reward-0") == first
        assert time.monotonic() - asked < 0.1  # the loop's questions never wait on the stage
        events = events_until(launcher, "restarted")
        took = time.monotonic() - frozen_at
        assert 3 <= took < 15, took
        assert len(events) == 2 and events[0].startswith("reward-0: did not answer for "), events
        assert events[0].endswith(" s (run.stage_timeout_s), killed; restarting in 0.2 s"), events
        assert events[1] == "reward-0: restarted (1 so far)", events
        assert not alive(pid) and launcher.pid("reward-0") != pid
        # the new process serves its own metrics: its URL, not its predecessor's from the same log
        second = wait_for_sync(lambda: launcher.supervise() is not None and launcher.metrics_url("reward-0"), 120,
                               "the new member's metrics")
        assert second != first
    finally:
        launcher.stop_all(timeout_s=10)
