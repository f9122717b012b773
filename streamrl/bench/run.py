"""``streamrl bench run``: the main job's speed, side by side with another streamrl.

The main job (``streamrl run`` on the packaged default, the embedded broker, every stage its own
process) for ``--versions`` versions, run by this streamrl and by another at the same time, each
in its own directory, round after round: both under the same load, so that the ratio holds on a
shared, noisy machine where either time alone does not. The other streamrl is a git revision of
this checkout (``--against REF``: its tree exported to a temporary directory and run on this
environment's dependencies, first on ``PYTHONPATH``) or another installed streamrl
(``--against-python``: that interpreter, e.g. a venv where an earlier release is installed).

Measured from each run's ``observation.json`` (when each version was announced, how many
rollouts each version generated): seconds per version after the warm start (from version 1's
announcement to the last's: the warm start and the stages' start-up apart) and rollouts per
second over the same span. Reported: each side's median over rounds, and per round the ratios
``against / this`` of seconds per version and ``this / against`` of rollouts per second (above
1: this streamrl is faster). Run it before a change to the learner, the rollout worker, the bus
or the supervisor lands (``--against main``), and put the ratio in the change's note.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import streamrl
from streamrl import plotting
from streamrl.bench import harness

HELP = "the main job against another tree or install of streamrl, both at once (ratios per round)"

SIDES = ("this", "against")


def source_root() -> Path:
    """The directory this streamrl is imported from (a checkout's root, or site-packages)."""
    return Path(streamrl.__file__).resolve().parent.parent


def export_tree(ref: str, repo: Path, into: Path) -> Path:
    """``git archive`` of ``ref`` in ``repo``, unpacked into ``into`` (its code, configs and
    topics: what ``streamrl run`` reads in a checkout)."""
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         capture_output=True, text=True)
    if sha.returncode:
        raise SystemExit(f"bench run: --against {ref!r} is not a revision of {repo} ({sha.stderr.strip()})")
    tar = into / "tree.tar"
    subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(tar), sha.stdout.strip()], check=True)
    tree = into / "tree"
    with tarfile.open(tar) as archive:
        archive.extractall(tree, filter="data")
    tar.unlink()
    return tree


def figures(run_dir: Path) -> dict[str, float]:
    """Seconds per version after the warm start and rollouts per second, from the observation a
    run keeps (``runs/<id>/observation.json``, read as ``streamrl run`` reads it on a resume:
    when each version was announced, how many rollouts each version generated), and the last
    version's mean reward."""
    from streamrl.supervisor.observer import Observation

    files = sorted(run_dir.glob("runs/*/observation.json"))
    if not files:
        raise RuntimeError(f"no runs/*/observation.json under {run_dir}: the run did not get far (see its logs)")
    obs = Observation.carried_over(json.loads(files[-1].read_text()), trained_base=0)
    last = max(obs.versions, default=0)
    if last < 2 or 1 not in obs.versions:
        raise RuntimeError(f"{files[-1]}: versions {sorted(obs.versions)}, too few to time")
    span = obs.versions[last] - obs.versions[1]
    rollouts = sum(s.records for v, s in obs.by_version.items() if 1 <= v < last)
    return {"versions": last, "s_per_version": span / (last - 1), "rollouts_per_s": rollouts / span,
            "reward_last": obs.by_version[last].mean if last in obs.by_version else float("nan")}


class RunBench(harness.Bench):
    name = "run"
    variants = ("side by side",)  # one run measures both streamrls at once (the same load)
    seconds_key = "seconds"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        if bool(args.against) == bool(args.against_python):
            raise SystemExit("bench run: give --against GIT_REF or --against-python PYTHON (one of them)")
        self.versions = args.versions or (12 if args.quick else 30)
        self.rounds = args.rounds or (1 if args.quick else 3)
        self.units = self.versions
        self.label = args.against or args.against_python

    def session(self) -> Any:
        @contextlib.contextmanager
        def sides() -> Any:
            with tempfile.TemporaryDirectory(prefix="streamrl-bench-run-") as tmp:
                self.tmp = Path(tmp)
                this_env = {"PYTHONPATH": str(source_root())}
                if self.args.against:
                    repo = Path(self.args.repo) if self.args.repo else source_root()
                    tree = export_tree(self.args.against, repo, self.tmp)
                    self.commands = {"this": (sys.executable, this_env), "against": (sys.executable, {"PYTHONPATH": str(tree)})}
                else:
                    self.commands = {"this": (sys.executable, this_env), "against": (self.args.against_python, {})}
                yield

        return sides()

    def _start(self, side: str, round_: int) -> tuple[subprocess.Popen, Path]:
        python, extra = self.commands[side]
        where = (self.out / self.name if self.out else self.tmp) / f"round{round_ + 1}-{side}"
        where.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
        cmd = [python, "-m", "streamrl", "run", f"learner.versions={self.versions}", *self.args.overrides]
        with open(where / "stdout.txt", "wb") as out, open(where / "stderr.txt", "wb") as err:
            return subprocess.Popen(cmd, cwd=where, env=env, stdout=out, stderr=err, start_new_session=True), where

    def measure(self, variant: str, round: int) -> dict[str, Any]:
        started = {side: self._start(side, round) for side in SIDES}  # both at once: the same load
        deadline = time.monotonic() + self.args.timeout_s
        while any(p.poll() is None for p, _ in started.values()):
            if time.monotonic() > deadline:
                for p, _ in started.values():
                    if p.poll() is None:
                        os.killpg(p.pid, 2)  # Ctrl-C: the run stops its stages
                raise SystemExit(f"bench run: round {round + 1} ran past --timeout-s {self.args.timeout_s}")
            self._tick(started["this"][1])
            time.sleep(1.0)
        result: dict[str, Any] = {}
        for side, (proc, where) in started.items():
            if proc.returncode:
                tail = (where / "stderr.txt").read_text(errors="replace")[-2000:]
                raise SystemExit(f"bench run: the {side} run exited {proc.returncode} ({where}):\n{tail}")
            result[side] = figures(where)
        result["speed"] = result["against"]["s_per_version"] / result["this"]["s_per_version"]
        result["rollouts"] = result["this"]["rollouts_per_s"] / result["against"]["rollouts_per_s"]
        self.note(f"round {round + 1}: {result['this']['s_per_version']:.2f} s/version here, "
                  f"{result['against']['s_per_version']:.2f} against: {result['speed']:.3f}x")
        return result

    def _tick(self, where: Path) -> None:
        """Move the bar to this side's announced versions."""
        for f in where.glob("runs/*/observation.json"):
            try:
                done = max((int(v) for v in json.loads(f.read_text())["versions"]), default=0)
            except (ValueError, KeyError, OSError):
                return
            base = len(self.runs[self.variants[0]]) * self.units
            self.progress.update(max(0, base + done - self.progress.n))

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        rounds = runs[self.variants[0]]
        med = {side: {k: round(statistics.median(r[side][k] for r in rounds), 3)
                      for k in ("s_per_version", "rollouts_per_s", "reward_last")} for side in SIDES}
        return {"versions": self.versions, "rounds": self.rounds, "against_ref": self.label,
                "overrides": list(self.args.overrides), **med,
                "speed_this_over_against": round(statistics.median(r["speed"] for r in rounds), 3),
                "rollouts_this_over_against": round(statistics.median(r["rollouts"] for r in rounds), 3),
                "speed_by_round": [round(r["speed"], 3) for r in rounds],
                "rollouts_by_round": [round(r["rollouts"], 3) for r in rounds]}

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        rows = [[f"round {i + 1}", f"{r['this']['s_per_version']:.2f}", f"{r['against']['s_per_version']:.2f}",
                 f"{r['speed']:.3f}", f"{r['this']['rollouts_per_s']:.1f}", f"{r['against']['rollouts_per_s']:.1f}",
                 f"{r['rollouts']:.3f}"] for i, r in enumerate(runs[self.variants[0]])]
        print(harness.table(["", "s/version this", f"s/version {self.label}", "speed ratio",
                             "rollouts/s this", f"rollouts/s {self.label}", "rollouts ratio"], rows))

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        plt = plotting.pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.2))
        rounds = runs[self.variants[0]]
        ax.bar([0, 1], [summary["this"]["s_per_version"], summary["against"]["s_per_version"]],
               color=["tab:blue", "tab:gray"], tick_label=["this", str(self.label)])
        for side, x in (("this", 0), ("against", 1)):
            ax.scatter([x] * len(rounds), [r[side]["s_per_version"] for r in rounds], color="black", zorder=3, s=12)
        ax.set_ylabel("seconds per version")
        ax.set_title(f"streamrl run, {self.versions} versions, both at once: {summary['speed_this_over_against']:.2f}x")
        plotting.save(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="12 versions, one round", bootstrap=False,
                                 out="where the JSON, the plot and each run's directory go")
    parser.add_argument("--against", default="", metavar="GIT_REF",
                        help="a revision of this checkout (e.g. main, HEAD~3): its tree, run on this environment")
    parser.add_argument("--against-python", default="", metavar="PYTHON",
                        help="or another environment's interpreter with streamrl installed")
    parser.add_argument("--repo", default="", help="the git checkout --against is read from (default: this streamrl's)")
    parser.add_argument("--versions", type=int, default=0, help="versions per run (default 30; --quick 12)")
    parser.add_argument("--rounds", type=int, default=0, help="pairs of runs (default 3; --quick 1)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="a round longer than this fails the bench")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed to both runs (streamrl run's overrides)")


def main(args: argparse.Namespace) -> int:
    return harness.run(RunBench(args))
