"""``streamrl bench soak``: the main job for thousands of versions, and whether anything grows.

A run of days is the shape users run; what grows with it (a stage's memory, its open
descriptors, the broker's topics, the learner's checkpoint) shows only over thousands of
versions. The bench runs the main job (``streamrl run`` on the packaged default, the embedded
broker, every stage its own process; ``--teacher``: with a teacher stage, weight deltas and the
archive on) for ``--versions`` versions and samples, every ``--sample-s`` seconds:

- every process of the run (the supervisor, the broker, each stage and its children), from
  ``/proc`` through psutil: resident memory, open descriptors, threads, child processes;
- the broker's topics: records held per topic (the watermarks' difference);
- each stage's consumer lag (``streamrl_consumer_lag_records`` from the metrics port it logs);
- the bytes of the run's archive, weights store and checkpoints, and the newest checkpoint's
  ``state.json`` (the learner's de-duplication window);
- the version reached (the run's ``observation.json``), for the rate.

Each series' slope per 1,000 versions is a least-squares line over the samples after the first
``--skip`` of the versions (start-up, the warm start and the first allocations apart). The
summary states the bounds it holds the run to (``--rss-bound-mb``, ``--fds-bound``,
``--threads-bound`` per 1,000 versions; the rate's last quarter against its first) and names
every series past them in ``grows``. ``--against REF`` runs another revision's job at the same
time (``streamrl bench run``'s export), sampled alike, so that two trees' slopes are measured
under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from streamrl import plotting
from streamrl.bench import harness

HELP = "the main job for thousands of versions: memory, descriptors, topics, lags over time, slopes per 1,000 versions"

#: the local job's prompts per version (learner.groups_per_mini_batch * mini_batches_per_version)
GROUPS_PER_VERSION = 16
#: with --teacher: a teacher stage (the tiny architecture from another seed), deltas, the archive
TEACHER = ["distillation.enabled=true", "teacher.seed=1", "learner.weights_delta=on"]
METRICS_URL = re.compile(r"metrics: (http://\S+/metrics)")
BROKER_LINE = re.compile(r"embedded broker: (\S+) \(pid")
#: which series a bound applies to: (prefix, the bound's argument)
BOUNDS = (("rss_mb.", "rss_bound_mb"), ("fds.", "fds_bound"), ("threads.", "threads_bound"),
          ("children.", "threads_bound"))


def stage_of(cmdline: list[str]) -> str:
    """A run's process by what it runs: ``broker`` (Tansu), a stage's verb (``-m streamrl VERB``)."""
    if cmdline and "tansu" in Path(cmdline[0]).name:
        return "broker"
    for i, arg in enumerate(cmdline[:-2]):
        if arg == "-m" and cmdline[i + 1] == "streamrl":
            return cmdline[i + 2]
    return Path(cmdline[0]).name if cmdline else "?"


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


class Sampler:
    """Samples one run (its supervisor's process and its directory) as the module doc says."""

    def __init__(self, proc: subprocess.Popen, where: Path):
        self.proc, self.where = proc, where
        self.samples: list[dict[str, Any]] = []
        self.started = time.time()
        self._broker: str | None = None

    def reached(self, versions: int) -> bool:
        """The run announced its last version: it is stopping (its processes leave; not sampled)."""
        return bool(self.samples) and self.samples[-1]["version"] >= versions

    def run_dir(self) -> Path | None:
        runs = sorted((self.where / "runs").glob("*/observation.json"))
        return runs[-1].parent if runs else None

    def version(self, run: Path | None) -> tuple[int, dict[int, float]]:
        if run is None:
            return 0, {}
        try:
            versions = {int(v): t for v, t in json.loads((run / "observation.json").read_text())["versions"].items()}
        except (OSError, ValueError, KeyError):
            return (self.samples[-1]["version"] if self.samples else 0), {}
        return max(versions, default=0), versions

    def processes(self) -> dict[str, dict[str, float]]:
        import psutil

        out: dict[str, dict[str, float]] = {}
        try:
            top = psutil.Process(self.proc.pid)
            procs = [("supervisor", top)] + sorted(
                ((stage_of(p.cmdline()), p) for p in top.children()), key=lambda sp: (sp[0], sp[1].create_time()))
        except psutil.Error:
            return out
        seen: dict[str, int] = {}
        for name, p in procs:
            n = seen.get(name, 0)
            seen[name] = n + 1
            key = name if name in ("supervisor", "broker", "learner", "feed", "archive") and not n else f"{name}#{n}"
            try:
                with p.oneshot():
                    kids = p.children(recursive=True)
                    kid_rss = 0
                    for k in kids:
                        with contextlib.suppress(psutil.Error):
                            kid_rss += k.memory_info().rss
                    out[key] = {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds(),
                                "threads": p.num_threads(), "children": len(kids), "children_rss_mb": kid_rss / 2**20}
            except psutil.Error:
                continue
        return out

    def topics(self) -> dict[str, int]:
        """Records held per topic on the broker: log end minus log start, every partition (the
        ends exact on the embedded broker too: ``bus.reader``)."""
        if self._broker is None:
            err = self.where / "stderr.txt"
            found = BROKER_LINE.search(err.read_text(errors="replace")) if err.exists() else None
            if found is None:
                return {}
            self._broker = found.group(1)
        try:
            return asyncio.run(asyncio.wait_for(topic_records(self._broker), 30))
        except Exception:  # noqa: BLE001 - a broker busy or going away: this sample has no sizes
            return {}

    def lags(self, run: Path | None) -> dict[str, float]:
        """Each stage's consumer lag, summed over its partitions, from the metrics it serves."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        if run is None:
            return out
        for log in sorted((run / "logs").glob("*.log")):
            try:
                urls = METRICS_URL.findall(log.read_text(errors="replace"))
                if not urls:
                    continue
                with urllib.request.urlopen(urls[-1], timeout=3) as r:
                    text = r.read().decode()
            except (OSError, ValueError):
                continue
            for family in text_string_to_metric_families(text):
                if family.name == "streamrl_consumer_lag_records":
                    out[log.stem] = sum(s.value for s in family.samples)
        return out

    def sample(self) -> dict[str, Any]:
        run = self.run_dir()
        version, _ = self.version(run)
        s: dict[str, Any] = {"t": time.time() - self.started, "version": version, "procs": self.processes(),
                             "topics": self.topics(), "lags": self.lags(run), "bytes_mb": {}}
        if run is not None:
            for part in ("archive", "weights", "checkpoints"):
                s["bytes_mb"][part] = _du(run / part) / 2**20
            states = sorted((run / "checkpoints").glob("ckpt-*/state.json"))
            with contextlib.suppress(OSError):
                if states:
                    s["bytes_mb"]["state_json"] = states[-1].stat().st_size / 2**20
        self.samples.append(s)
        return s



async def topic_records(bootstrap: str) -> dict[str, int]:
    """Records held per topic (every topic the run has, by its full name)."""
    from streamrl.bus import Bus
    from streamrl.bus.reader import Reader
    from streamrl.config import BusConfig
    from streamrl.topics import TOPIC_NAMES

    bus = Bus(BusConfig(bootstrap_servers=bootstrap))
    sizes: dict[str, int] = {}
    for name in TOPIC_NAMES:
        reader = Reader(bus, [name], "bench")
        try:
            await reader.start()
        except LookupError:
            await reader.stop()
            continue
        try:
            ends = await reader.end_offsets()
            starts = await reader.beginning_offsets()
            sizes[bus.topic(name)] = sum(max(0, end - starts.get(tp, 0)) for tp, end in ends.items())
        finally:
            await reader.stop()
    return sizes


def series(samples: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every measured figure as ``name -> [(version, value)]``: ``rss_mb.learner``,
    ``topic_records.streamrl.rewarded``, ``lag.reward-0``, ``bytes_mb.archive``, ..."""
    out: dict[str, list[tuple[int, float]]] = {}
    for s in samples:
        v = s["version"]
        for proc, figs in s["procs"].items():
            for k, val in figs.items():
                out.setdefault(f"{k}.{proc}", []).append((v, val))
        for group, prefix in (("topics", "topic_records"), ("lags", "lag"), ("bytes_mb", "bytes_mb")):
            for k, val in s[group].items():
                out.setdefault(f"{prefix}.{k}", []).append((v, val))
    return out


def rates(samples: list[dict[str, Any]], parts: int = 4) -> list[float]:
    """Versions per second in each of ``parts`` equal spans of time after the first version."""
    live = [s for s in samples if s["version"] >= 1]
    if len(live) < parts + 1:
        return []
    t0, t1 = live[0]["t"], live[-1]["t"]
    out = []
    for i in range(parts):
        lo, hi = t0 + (t1 - t0) * i / parts, t0 + (t1 - t0) * (i + 1) / parts
        inside = [s for s in live if lo <= s["t"] <= hi]
        if len(inside) < 2 or inside[-1]["t"] == inside[0]["t"]:
            out.append(0.0)
            continue
        out.append((inside[-1]["version"] - inside[0]["version"]) / (inside[-1]["t"] - inside[0]["t"]))
    return out


def analyse(samples: list[dict[str, Any]], skip: float, bounds: dict[str, float]) -> dict[str, Any]:
    """Slopes per 1,000 versions (after the first ``skip`` of the versions), first and last
    values in that window, the lags' maxima, the rate by quarter, and which series grow past
    ``bounds`` (``rss_bound_mb``, ``fds_bound``, ``threads_bound``, ``rate_drop``)."""
    last = max((s["version"] for s in samples), default=0)
    start = int(last * skip)
    figs: dict[str, Any] = {}
    grows: list[str] = []
    for name, points in sorted(series(samples).items()):
        window = [(v, y) for v, y in points if v >= start]
        if len(window) < 2:
            continue
        per_1000 = slope([v for v, _ in window], [y for _, y in window]) * 1000
        figs[name] = {"slope_per_1000": round(per_1000, 3), "first": round(window[0][1], 3),
                      "last": round(window[-1][1], 3), "max": round(max(y for _, y in points), 3)}
        for prefix, bound in BOUNDS:
            if name.startswith(prefix) and per_1000 > bounds[bound]:
                grows.append(name)
    by_quarter = rates(samples)
    rate_ratio = by_quarter[-1] / by_quarter[0] if by_quarter and by_quarter[0] > 0 else float("nan")
    if by_quarter and rate_ratio < 1 - bounds["rate_drop"]:
        grows.append("versions_per_s (falls)")
    elapsed = samples[-1]["t"] if samples else 0.0
    lag_max = {k[4:]: v["max"] for k, v in figs.items() if k.startswith("lag.")}
    return {"versions": last, "elapsed_s": round(elapsed, 1), "samples": len(samples),
            "versions_per_s": round(last / elapsed, 4) if elapsed else 0.0,
            "versions_per_s_by_quarter": [round(r, 4) for r in by_quarter],
            "rate_last_over_first_quarter": round(rate_ratio, 3), "from_version": start,
            "lag_max": lag_max, "grows": grows, "series": figs}


class SoakBench(harness.Bench):
    name = "soak"
    variants = ("soak",)
    seconds_key = "seconds"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.versions = args.versions or (30 if args.quick else 2000)
        self.units = self.versions
        self.sides = ("this", "against") if args.against else ("this",)
        self.bounds = {"rss_bound_mb": args.rss_bound_mb, "fds_bound": args.fds_bound,
                       "threads_bound": args.threads_bound, "rate_drop": args.rate_drop}

    def session(self) -> Any:
        @contextlib.contextmanager
        def trees() -> Any:
            from streamrl.bench.run import export_tree, source_root

            tmp = Path(tempfile.mkdtemp(prefix="streamrl-bench-soak-"))
            try:
                self.tmp = tmp
                self.paths = {"this": str(source_root())}
                if self.args.against:
                    self.paths["against"] = str(export_tree(self.args.against, source_root(), tmp))
                yield
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        return trees()

    def overrides(self) -> list[str]:
        """The main job, long enough: prompts for every version (the feed's ``limit``), no run
        timeout short of the bench's own, a checkpoint every version as the default has."""
        rows = GROUPS_PER_VERSION * (self.versions + 8)
        extra = list(TEACHER) if self.args.teacher else []
        return [f"learner.versions={self.versions}", f"feed.limit={rows}", f"run.timeout_s={self.args.timeout_s}",
                *extra, *self.args.overrides]

    def _start(self, side: str) -> tuple[subprocess.Popen, Path]:
        where = (self.out / self.name if self.out else self.tmp) / side
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": self.paths[side], "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "streamrl", "run", *self.overrides()]
        with open(where / "stdout.txt", "wb") as out, open(where / "stderr.txt", "wb") as err:
            return subprocess.Popen(cmd, cwd=where, env=env, stdout=out, stderr=err, start_new_session=True), where

    def measure(self, variant: str, round: int) -> dict[str, Any]:
        samplers = {side: Sampler(*self._start(side)) for side in self.sides}
        deadline = time.monotonic() + self.args.timeout_s
        try:
            while any(s.proc.poll() is None for s in samplers.values()):
                if time.monotonic() > deadline:
                    for s in samplers.values():
                        if s.proc.poll() is None:
                            os.killpg(s.proc.pid, 2)  # Ctrl-C: the run stops its stages
                    self.note(f"bench soak: past --timeout-s {self.args.timeout_s}: stopped (figures to here)")
                    break
                for s in samplers.values():
                    if s.proc.poll() is None and not s.reached(self.versions):
                        s.sample()
                done = samplers["this"].samples[-1]["version"] if samplers["this"].samples else 0
                self.progress.update(max(0, done - self.progress.n))
                time.sleep(self.args.sample_s)
            for s in samplers.values():
                s.proc.wait(timeout=self.args.timeout_s)
        finally:
            for s in samplers.values():
                if s.proc.poll() is None:
                    os.killpg(s.proc.pid, 9)
        result: dict[str, Any] = {}
        for side, s in samplers.items():
            if s.proc.returncode and not s.samples:
                tail = (s.where / "stderr.txt").read_text(errors="replace")[-2000:]
                raise SystemExit(f"bench soak: the {side} run exited {s.proc.returncode} ({s.where}):\n{tail}")
            (s.where / "samples.json").write_text(json.dumps(s.samples))
            result[side] = {"returncode": s.proc.returncode, "samples": s.samples, "dir": str(s.where)}
        return result

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        run = runs["soak"][0]
        out: dict[str, Any] = {"versions_asked": self.versions, "teacher": self.args.teacher,
                               "overrides": self.overrides(), "against_ref": self.args.against or None,
                               "skip": self.args.skip, "bounds_per_1000_versions": self.bounds}
        for side in self.sides:
            out[side] = {"returncode": run[side]["returncode"], "dir": run[side]["dir"],
                         **analyse(run[side]["samples"], self.args.skip, self.bounds)}
        return out

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        keys = sorted({k for side in self.sides for k in summary[side]["series"]
                       if k.split(".")[0] in ("rss_mb", "fds", "threads", "children", "lag", "topic_records", "bytes_mb")})
        rows = [[k, *(f"{summary[side]['series'].get(k, {}).get('slope_per_1000', float('nan')):.2f}"
                      for side in self.sides)] for k in keys]
        print(harness.table(["per 1,000 versions", *self.sides], rows))
        for side in self.sides:
            s = summary[side]
            print(f"{side}: {s['versions']} versions in {s['elapsed_s']:.0f} s ({s['versions_per_s']:.3f}/s; by "
                  f"quarter {s['versions_per_s_by_quarter']}); grows: {', '.join(s['grows']) or 'nothing'}")

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        plt = plotting.pyplot()
        panels = ("rss_mb", "fds", "threads", "topic_records", "lag", "bytes_mb")
        fig, axes = plt.subplots(len(panels) + 1, len(self.sides), figsize=(7 * len(self.sides), 2.6 * (len(panels) + 1)),
                                 squeeze=False)
        for col, side in enumerate(self.sides):
            samples = runs["soak"][0][side]["samples"]
            named = series(samples)
            for row, panel in enumerate(panels):
                ax = axes[row][col]
                for name, points in sorted(named.items()):
                    if name.split(".")[0] == panel:
                        ax.plot([v for v, _ in points], [y for _, y in points], label=name.split(".", 1)[1], lw=1)
                ax.set_ylabel(panel)
                ax.set_title(side if row == 0 else "", fontsize=9)
                if ax.lines:
                    ax.legend(fontsize=6, ncol=3)
            ax = axes[-1][col]
            ax.plot([s["t"] for s in samples], [s["version"] for s in samples])
            ax.set_xlabel("seconds")
            ax.set_ylabel("version")
        for ax in axes[:-1].flat:
            ax.set_xlabel("version")
        plotting.save(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="30 versions", bootstrap=False,
                                 out="where the JSON, the plot and the run's directory go")
    parser.add_argument("--versions", type=int, default=0, help="versions of the main job (default 2000; --quick 30)")
    parser.add_argument("--teacher", action="store_true", help="with a teacher stage and weight deltas")
    parser.add_argument("--against", default="", metavar="GIT_REF",
                        help="also run this revision of the checkout at the same time, sampled alike")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--skip", type=float, default=0.25, help="the first fraction of versions left out of the slopes")
    parser.add_argument("--rss-bound-mb", type=float, default=40.0,
                        help="a process's RSS growth per 1,000 versions that counts as growing")
    parser.add_argument("--fds-bound", type=float, default=10.0, help="open descriptors per 1,000 versions, likewise")
    parser.add_argument("--threads-bound", type=float, default=10.0, help="threads (and child processes) per 1,000 versions")
    parser.add_argument("--rate-drop", type=float, default=0.25,
                        help="the rate's last quarter below (1 - this) x its first counts as a falling rate")
    parser.add_argument("--timeout-s", type=float, default=6 * 3600.0, help="stop the run (figures to there) after this long")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed to the run (streamrl run's overrides)")


def main(args: argparse.Namespace) -> int:
    return harness.run(SoakBench(args))
