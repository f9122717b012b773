"""``streamrl bench scale``: reward throughput against the number of reward group members.

For each size (``--members``, default 1, 2 and 4) on fresh topics: that many
``python -m streamrl reward`` processes (the CLI itself) join one consumer group on ``rollouts``
(8 partitions) and score trajectories with an LLM judge entry pointing at a local judge server
(another process) that answers after a fixed latency. Each member may have
``--judge-concurrency`` requests in flight (``judge.concurrency``, per member), so the judge is
the bottleneck and the bound is ``members * concurrency / latency``.

The clock starts only when the group has settled: every member owns partitions (each member's
``streamrl_reward_partition_share``, scraped from its metrics port, is above zero and the shares
sum to one). Then a backlog larger than the measurement needs is produced at once. With a fixed
latency the judge answers in waves (every member's slots refill together), so throughput is
measured over whole waves: with the rewarded records ordered by ``scored_at``, ``K`` records
(``K`` = members x concurrency x the waves in ``--window-s``) from rank ``k1`` (two waves in, past
the ramp) take ``t[k1 + K] - t[k1]`` seconds; both ends sit at the same point of a wave.

Last line of stdout: one JSON object with ``scale_2`` and ``scale_4`` (throughput with 2 and 4
members over 1), the throughputs and their ratio to the bound.

``--pipeline``: the reward group fed by the pipeline itself, not by a synthetic producer whose
keys are spread evenly (issue 36: the real pipeline put every trajectory of a version on one
partition, and one reward member scored everything). For each size, ``streamrl run`` (the main
job, the embedded default's task) for ``--versions`` versions with that many reward members, on
fresh topics of the bench's broker; then ``streamrl.rollouts`` is read back by partition. It
reports the records each reward member committed (the run's summary, ``records_per_member``),
the seconds per version (the learner's announcements, version 1 to the last), and the spread:
records per partition against an even share, and the partitions each version's trajectories
span. The last line is one JSON object, ``pipeline`` a row per size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

from streamrl.bench import harness
from streamrl.plotting import pyplot, save
from streamrl.reward.config import ScorerSpec
from streamrl.topics import ensure_topics, load_specs

HELP = ("reward group scaling: throughput with 1, 2 and 4 members against a latency-bound judge; "
        "--pipeline: records per member and seconds per version through the real pipeline")

DATA_SOURCE = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="a short run (under 2 minutes)", out="where the JSON, plot and logs go")
    parser.add_argument("--members", default="1,2,4", help="group sizes to measure (the first is the base)")
    parser.add_argument("--judge-latency-ms", type=float, default=500.0, help="fixed judge latency")
    parser.add_argument("--judge-concurrency", type=int, default=8, help="requests in flight per member")
    parser.add_argument("--window-s", type=float, default=0.0, help="measured window (default 8 s, --quick 4 s)")
    parser.add_argument("--pipeline", action="store_true",
                        help="the reward group fed by the real pipeline (streamrl run: feed, rollout worker, "
                             "learner), not a synthetic producer: records per member, seconds per version")
    parser.add_argument("--versions", type=int, default=0, help="--pipeline: versions per run (default 12, --quick 6)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="--pipeline: more overrides for each run (topics.rollouts.partitions=16)")


def bound_per_s(members: int, concurrency: int, latency_s: float) -> float:
    return members * concurrency / latency_s


def reward_config(bootstrap: str, judge_url: str, concurrency: int, run_id: str):
    from streamrl.pipeline_config import PipelineConfig

    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = bootstrap
    cfg.bus.topic_prefix = f"bench{uuid.uuid4().hex[:8]}"
    cfg.reward.group = f"{run_id}-reward"
    cfg.reward.max_in_flight = 4 * concurrency
    cfg.reward.scorers["bench_judge"] = ScorerSpec(
        type="judge", data_sources=[DATA_SOURCE],
        judge={"urls": [judge_url], "concurrency": concurrency, "timeout_s": 30.0,
               "health_interval_s": 0.0, "max_tokens": 64})
    return cfg


def _metrics_port(log: Path) -> int | None:
    found = re.search(r"metrics: http://[^:]+:(\d+)/metrics", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


def _partition_share(port: int, group: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "streamrl_reward_partition_share":
            return sum(s.value for s in family.samples if s.labels.get("group") == group)
    return 0.0


async def wait_settled(launcher, names: list[str], logs: Path, group: str, timeout_s: float) -> float:
    """Wait until every member owns partitions and the shares sum to one, for a second; returns
    the seconds waited."""
    started = time.monotonic()
    stable_since = None
    while time.monotonic() - started < timeout_s:
        failed = launcher.failed()
        if failed:
            raise RuntimeError(f"bench scale: {failed} exited:\n{launcher.log_tail(failed)}")
        ports = [_metrics_port(logs / f"{n}.log") for n in names]
        shares = []
        if all(ports):
            try:
                shares = [await asyncio.to_thread(_partition_share, p, group) for p in ports]
            except OSError:
                shares = []
        if shares and all(s > 0 for s in shares) and abs(sum(shares) - 1.0) < 1e-6:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= 1.0:
                return time.monotonic() - started
        else:
            stable_since = None
        await asyncio.sleep(0.2)
    raise RuntimeError(f"bench scale: the group of {len(names)} did not settle in {timeout_s:.0f}s")


async def measure_group(members: int, args: argparse.Namespace, bootstrap: str, judge_url: str,
                  out: Path, window_s: float) -> dict[str, Any]:
    """One group size: start the members, let them settle, produce a backlog, count a window."""
    from streamrl.bench._stages import write_config
    from streamrl.bus import Bus, Reader
    from streamrl.config import RestartConfig
    from streamrl.records import Rewarded, Trajectory
    from streamrl.supervisor.launcher import LocalLauncher

    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-members{members}"
    run_dir = out / "scale" / run_id
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg = reward_config(bootstrap, judge_url, args.judge_concurrency, run_id)
    cfg_path = write_config(cfg, run_dir / "pipeline.yaml")
    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    latency = args.judge_latency_ms / 1000
    bound = bound_per_s(members, args.judge_concurrency, latency)
    wave = members * args.judge_concurrency
    k1, span = 2 * wave, wave * max(1, round(window_s / latency))
    need = k1 + span + 1 + wave  # a wave more: records scored earlier may still be on their way
    backlog = need + members * cfg.reward.max_in_flight
    launcher = LocalLauncher(logs, RestartConfig(max_restarts=0))  # a crash fails the bench
    names = [f"reward-{i}" for i in range(members)]
    reader = await Reader(bus, ["rewarded"], "bench").start()
    try:
        for n in names:
            launcher.start(n, ["reward", "--config", str(cfg_path), "--bootstrap-servers", bootstrap,
                               "metrics.port=0"], "reward")
        settle_s = await wait_settled(launcher, names, logs, cfg.reward.group, timeout_s=90)
        async with bus.producer("bench") as producer:
            await asyncio.gather(*[await producer.send(Trajectory(
                group_id=f"g{i}", group_size=1, policy_version=0, data_source=DATA_SOURCE,
                prompt="How many clips did Natalia sell altogether in April and May?",
                response=f"She sold 48 / 2 = 24 in May and 48 + 24 = 72 in all. (#{i})\n#### 72",
                ground_truth="72")) for i in range(backlog)])
        scored: list[float] = []
        seen: set[str] = set()
        deadline = time.monotonic() + window_s + 60
        while time.monotonic() < deadline:
            for msg in await reader.fetch(timeout_ms=200):
                rec = Rewarded.decode(msg.value)
                if rec.id not in seen:
                    seen.add(rec.id)
                    scored.append(rec.scored_at)
            if len(scored) >= need:
                break
            failed = launcher.failed()
            if failed:
                raise RuntimeError(f"bench scale: {failed} exited:\n{launcher.log_tail(failed)}")
    finally:
        await asyncio.to_thread(launcher.stop_all, 15.0)
        await reader.stop()
    if len(scored) < need:
        raise RuntimeError(f"bench scale: {len(scored)} of {need} records scored with "
                           f"{members} members; logs in {logs}")
    scored.sort()
    rate = span / (scored[k1 + span] - scored[k1])
    print(f"  {members} member(s): {rate:.1f} records/s (bound {bound:.1f}), settled in {settle_s:.1f}s",
          file=sys.stderr, flush=True)
    return {"members": members, "per_s": rate, "bound_per_s": bound, "records_measured": span,
            "settle_s": settle_s}


async def topic_spread(bus, topic: str = "rollouts") -> dict[str, Any]:
    """``topic`` (rollouts or rewarded) read back by partition: records per partition, the
    partitions each policy version's records span, and the groups found on more than one
    partition (0: every group whole, as group-level reward hooks need)."""
    import orjson

    from streamrl.bus import Reader

    per_partition: dict[int, int] = {}
    by_version: dict[int, set[int]] = {}
    homes: dict[str, set[int]] = {}
    async with Reader(bus, [topic], "bench") as reader:
        per_partition = {tp.partition: 0 for tp in reader.partitions}
        ends = await reader.end_offsets()
        async for batch in reader.read(stop=ends):
            for msg in batch:
                rec = orjson.loads(msg.value)
                per_partition[msg.partition] += 1
                by_version.setdefault(int(rec["policy_version"]), set()).add(msg.partition)
                homes.setdefault(str(rec["group_id"]), set()).add(msg.partition)
    total = sum(per_partition.values())
    even = total / max(1, len(per_partition))
    return {"records": total, "per_partition": [per_partition[p] for p in sorted(per_partition)],
            "vs_even": [round(per_partition[p] / even, 2) for p in sorted(per_partition)] if total else [],
            "version_span": {str(v): len(ps) for v, ps in sorted(by_version.items())},
            "split_groups": sum(1 for ps in homes.values() if len(ps) > 1)}


async def seconds_per_version(bus) -> float | None:
    """Seconds between the learner's announcements of version 1 and of its last, per version
    (the warm start and the first version's start-up left out)."""
    from streamrl.bus import Reader
    from streamrl.records import POLICY

    announced: dict[int, float] = {}
    async with Reader(bus, [POLICY], "bench") as reader:
        async for batch in reader.read(stop=await reader.end_offsets()):
            for msg in batch:
                pv = POLICY.decode(msg.value)
                announced.setdefault(pv.version, pv.created_at)
    last = max(announced, default=0)
    if last < 2 or 1 not in announced:
        return None
    return (announced[last] - announced[1]) / (last - 1)


def run_pipeline(bootstrap: str, prefix: str, out: Path, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """``streamrl run`` (the embedded default's config) on ``bootstrap`` with topics ``prefix``;
    its summary (the last line of its stdout). Its stderr goes to ``out/run.log``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "run.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "streamrl", "run", "local.yaml", "--bootstrap-servers", bootstrap,
                               f"bus.topic_prefix={prefix}", f"run.out_dir={out}", "run.resume=never", *overrides],
                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench scale --pipeline: streamrl run exited {proc.returncode}; see {out / 'run.log'}")
    return json.loads(lines[-1])


async def measure_pipeline(members: int, args: argparse.Namespace, bootstrap: str, out: Path) -> dict[str, Any]:
    """One reward group size through the whole pipeline: records per member, seconds per
    version, and how the trajectories spread over ``rollouts``."""
    from streamrl.bus import Bus
    from streamrl.config import BusConfig

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    overrides = [f"run.reward_members={members}", f"learner.versions={args.versions}", *args.overrides]
    summary = await asyncio.to_thread(run_pipeline, bootstrap, prefix, out / "scale-pipeline" / prefix,
                                      overrides, 900.0)
    bus = Bus(BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix))
    per_member = summary.get("records_per_member", {}).get("reward", {})
    scored = sum(per_member.values())
    row = {"members": members, "versions": summary["versions"], "per_member": per_member,
           "member_share": [round(n / scored, 3) for n in per_member.values()] if scored else [],
           "seconds_per_version": await seconds_per_version(bus), **await topic_spread(bus, "rollouts"),
           **{f"rewarded_{k}": v for k, v in (await topic_spread(bus, "rewarded")).items()
              if k in ("per_partition", "split_groups")}}
    spv = row["seconds_per_version"]
    print(f"  {members} member(s): records per member {list(per_member.values())}, "
          f"{spv:.2f} s/version" if spv else "", f"rollouts per partition {row['per_partition']}",
          file=sys.stderr, flush=True)
    return row


def pipeline_table(rows: list[dict[str, Any]]) -> str:
    """The rows as BENCHMARKS.md shows them."""
    lines = [f"{'members':>7s} {'s/version':>9s} {'records per member':28s} {'rollouts per partition (x even)':s}"]
    for r in rows:
        spv = f"{r['seconds_per_version']:.2f}" if r["seconds_per_version"] else "-"
        lines.append(f"{r['members']:7d} {spv:>9s} {' / '.join(map(str, r['per_member'].values())):28s} "
                     f"{min(r['vs_even'], default=0):.2f}-{max(r['vs_even'], default=0):.2f}, "
                     f"versions span {min(r['version_span'].values(), default=0)}-"
                     f"{max(r['version_span'].values(), default=0)} of {len(r['per_partition'])}")
    return "\n".join(lines)


class ScalePipelineBench(harness.Bench):
    """``--pipeline``: one ``streamrl run`` per reward group size."""

    name = "scale-pipeline"
    broker = True

    def __init__(self, args: argparse.Namespace, sizes: list[int]):
        super().__init__(args)
        self.variants = sizes

    def measure(self, members: int, round: int) -> dict[str, Any]:
        return asyncio.run(measure_pipeline(members, self.args, self.bus.bootstrap_servers, self.out))

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        return {"pipeline": list(runs.single().values()), "versions": self.args.versions,
                "overrides": self.args.overrides}

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        print(pipeline_table(summary["pipeline"]))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    members = [r["members"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(members, [r["bound_per_s"] for r in rows], linestyle="--", color="#c0392b",
            label="bound: members x concurrency / latency")
    base = rows[0]["per_s"] / rows[0]["members"]
    ax.plot(members, [base * m for m in members], linestyle=":", color="#888888", label="linear from the first")
    ax.plot(members, [r["per_s"] for r in rows], marker="o", color="#3a7dc9", label="measured")
    ax.set(xlabel="reward group members", ylabel="rewarded records / s", title="Reward group scaling",
           xticks=members)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path, dpi=80)


class ScaleBench(harness.Bench):
    """One run per group size (``--members``), against one judge server."""

    name = "scale"
    broker = True

    def __init__(self, args: argparse.Namespace, sizes: list[int]):
        super().__init__(args)
        self.variants, self.window_s = sizes, args.window_s or (4.0 if args.quick else 8.0)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        from streamrl.bench._sim import SimServer, serve_judge

        a, latency = self.args, self.args.judge_latency_ms / 1000
        self.note(f"bench scale: members {self.variants}, judge {a.judge_latency_ms:g} ms x {a.judge_concurrency} "
                  f"per member, {self.window_s:g}s windows")
        with SimServer(serve_judge, latency, latency) as judge:
            self.judge_url = judge.url
            yield

    def measure(self, members: int, round: int) -> dict[str, Any]:
        return asyncio.run(measure_group(members, self.args, self.bus.bootstrap_servers, self.judge_url, self.out,
                                         self.window_s))

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        rows = list(runs.single().values())
        base = rows[0]
        result: dict[str, Any] = {f"scale_{r['members']}": round(r["per_s"] / base["per_s"], 3) for r in rows[1:]}
        return {**result, "base_members": base["members"],
                "per_s": {str(r["members"]): round(r["per_s"], 2) for r in rows},
                "bound_per_s": {str(r["members"]): round(r["bound_per_s"], 2) for r in rows},
                "vs_bound": {str(r["members"]): round(r["per_s"] / r["bound_per_s"], 3) for r in rows},
                "records_measured": {str(r["members"]): r["records_measured"] for r in rows},
                "judge_latency_ms": self.args.judge_latency_ms, "judge_concurrency": self.args.judge_concurrency,
                "window_s": self.window_s, "partitions": load_specs()["rollouts"].partitions}

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        rows = list(runs.single().values())
        print(harness.table(["members", "records/s", "bound/s", "vs bound", "scale"],
                            [[r["members"], f"{r['per_s']:.1f}", f"{r['bound_per_s']:.1f}",
                              f"{r['per_s'] / r['bound_per_s']:.2f}", f"{r['per_s'] / rows[0]['per_s']:.2f}"]
                             for r in rows]))

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        plot(list(runs.single().values()), path)


def main(args: argparse.Namespace) -> int:
    sizes = [int(m) for m in args.members.split(",") if m.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit("streamrl bench scale: --members wants sizes >= 1, e.g. 1,2,4")
    if args.pipeline:
        args.versions = args.versions or (6 if args.quick else 12)
        return harness.run(ScalePipelineBench(args, sizes))
    if args.overrides:
        raise SystemExit("streamrl bench scale: key=value overrides are for --pipeline runs")
    return harness.run(ScaleBench(args, sizes))
