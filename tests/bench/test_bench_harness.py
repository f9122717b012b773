"""``streamrl.bench.harness``, on tiny declared benches: the runs go variants x rounds with rounds
outer, inside the bench's session (sync or async); medians and best-of come from the runs by
variant; the summary is written as ``OUT/NAME.json`` and printed as the last stdout line, with the
bench's wall time and the plot's path; the plot is a PNG."""

from __future__ import annotations

import asyncio
import contextlib
import json
from argparse import Namespace
from pathlib import Path

import pytest

from streamrl.bench import harness
from streamrl.plotting import pyplot, save
from tests.helpers import last_json_line

#: what each (variant, round) measures: medians over rounds 2.0 and 20.0, best 3.0 and 30.0
VALUES = {("a", 0): 3.0, ("a", 1): 1.0, ("a", 2): 2.0, ("b", 0): 10.0, ("b", 1): 30.0, ("b", 2): 20.0}


class Tiny(harness.Bench):
    name = "tiny"
    variants = ("a", "b")
    rounds = 3

    def __init__(self, args: Namespace):
        super().__init__(args)
        self.calls: list[tuple[str, int]] = []
        self.events: list[str] = []

    @contextlib.contextmanager
    def session(self):
        self.events.append("enter")
        try:
            yield
        finally:
            self.events.append("exit")

    def measure(self, variant: str, round: int) -> dict[str, float]:
        assert self.events == ["enter"]  # inside the session
        self.calls.append((variant, round))
        if variant == "b":  # an earlier run of this round is there to read
            assert self.runs["a"][-1]["x"] == VALUES["a", round]
        return {"x": VALUES[variant, round], "y": 1.0}

    def summary(self, runs: harness.Runs) -> dict:
        return {"median_a": runs.median("a", "x"), "medians_b": runs.medians("b"), "best_b": runs.best("b", "x"),
                "ratio": runs.median("b", "x") / runs.median("a", "x")}

    def report(self, runs: harness.Runs, summary: dict) -> None:
        print(harness.table(["variant", "median x"], [[v, f"{runs.median(v, 'x'):.1f}"] for v in runs]))

    def plot(self, runs: harness.Runs, summary: dict, path: Path) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.bar(list(runs), [runs.median(v, "x") for v in runs])
        save(fig, path)


def test_runs_go_rounds_outer_and_the_summary_is_written_printed_and_plotted(tmp_path, capsys):
    bench = Tiny(Namespace(out=str(tmp_path)))
    assert harness.run(bench) == 0
    assert bench.calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert bench.events == ["enter", "exit"]

    out = capsys.readouterr().out
    res = last_json_line(out)
    assert res["median_a"] == 2.0 and res["medians_b"] == {"x": 20.0, "y": 1.0} and res["best_b"] == 30.0
    assert res["ratio"] == 10.0
    assert list(res)[-2:] == ["seconds", "plot"] and 0 <= res["seconds"] < 60  # the harness's keys come last
    assert res["plot"] == str(tmp_path / "tiny.png")
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "tiny.json").read_text()) == res
    assert out.splitlines()[-4:-1] == ["variant median x", "a            2.0", "b           20.0"]  # the report


def test_an_async_bench_runs_in_one_loop_in_its_async_session_and_ticks_its_own_progress(capsys):
    class Ticking(harness.Bench):
        name = "ticking"
        variants = ("fast", "slow")
        units = 4  # steps per run
        seconds_key = None  # not reported

        @contextlib.asynccontextmanager
        async def session(self):
            self.loop = asyncio.get_running_loop()
            yield
            self.loop = None

        async def measure(self, variant: str, round: int) -> int:
            assert asyncio.get_running_loop() is self.loop
            for _ in range(2 if variant == "fast" else 4):  # the harness moves the bar past the rest
                self.progress.update(1)
            return self.progress.n

        def summary(self, runs: harness.Runs) -> dict:
            return runs.single()

    bench = Ticking(Namespace())
    assert bench.out is None  # no --out: stdout only
    harness.run(bench)
    assert last_json_line(capsys.readouterr().out) == {"fast": 2, "slow": 8}
    assert bench.progress is None and bench.loop is None


def test_a_failing_run_leaves_the_session_and_writes_nothing(tmp_path, capsys):
    class Failing(Tiny):
        def measure(self, variant: str, round: int) -> dict[str, float]:
            if (variant, round) == ("b", 1):
                raise RuntimeError("run b failed")
            return super().measure(variant, round)

    bench = Failing(Namespace(out=str(tmp_path)))
    with pytest.raises(RuntimeError, match="run b failed"):
        harness.run(bench)
    assert bench.events == ["enter", "exit"] and bench.runs.values_of("a", "x") == [3.0, 1.0]
    assert not (tmp_path / "tiny.json").exists() and capsys.readouterr().out == ""


def test_a_broker_bench_gets_the_bus_config_of_the_given_broker(bootstrap, capsys):
    class OnTheBroker(harness.Bench):
        name = "broker"
        broker = True

        def measure(self, variant: str, round: int) -> str:
            return self.bus.bootstrap_servers

        def summary(self, runs: harness.Runs) -> dict:
            return {"bootstrap": runs.single()["run"]}

    harness.run(OnTheBroker(Namespace(bootstrap_servers=bootstrap)))
    assert last_json_line(capsys.readouterr().out)["bootstrap"] == bootstrap


def test_table_aligns_the_first_column_left_and_the_others_right():
    assert harness.table(["run", "s"], [["sync", "5.52"], ["staleness 1", "2.1"]]).splitlines() == [
        "run            s", "sync        5.52", "staleness 1  2.1"]
