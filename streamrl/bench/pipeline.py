"""``streamrl bench pipeline``: the streaming pipeline against a synchronous barrier, side by side.

One workload, run in one invocation on one broker:

(a) **synchronous**, as verl's default trainer runs: generate a batch, score the whole batch,
    train on it, publish the weights, repeat. In this process, no queue, the same components:
    the rollout ``run_group`` over the same backend, the reward stage's own ``Scoring`` (retries,
    fp32 rewards) over the same judge, the same learner trainer and weight writer;
(b) **streaming** through the real stages, each its own process: rollout worker
    (``RolloutWorker``), reward group member (``python -m streamrl reward``, the CLI itself),
    learner (``Learner``), with the rollout staleness gate and the learner's staleness bound at
    ``max_staleness`` 1 and then 2.

Simulated costs (this machine has no GPU; see ``_sim``):

- generation: a local OpenAI completions server, ``--gen-latency`` seconds per request of one
  prompt's ``group_size`` samples (a GPU engine samples them together); each worker keeps
  ``--prompts-in-flight`` prompts going;
- judge: a local OpenAI chat server whose latency is log-uniform between ``--judge-low-ms`` and
  ``--judge-high-ms`` (the asynchronous reward work this follows saw 1 to 40 s per sample; this
  is the same 40x spread, scaled down 100x), ``--judge-concurrency`` requests in flight;
- learner: a **fixed step time** (``--step-s`` per mini-batch, ``--mini-batches`` updates per
  version as verl's ``train_batch_size / ppo_mini_batch_size``) on the real learner: groups,
  staleness, de-duplication, offsets, weights written and announced every version are real;
  only the gradient arithmetic is replaced by its duration. Why not the tiny model's real step:
  on this 2-core machine shared with the stages, the simulated servers and other work, a CPU
  step (0.4 to 0.6 s for 32 sequences, measured) competes with the other stages for the same
  cores in the streaming run and not in the synchronous one, which on a GPU cluster (stages on
  their own devices) it would not; a fixed time keeps the bound exact and the comparison about
  the pipeline.

With ``--teacher-members 1,2,4`` (on-policy distillation, ``docs/guides/distillation.md``) a
teacher stage joins, in line after the reward group as ``streamrl run`` places it: a local OpenAI
completions server answering vLLM's ``prompt_logprobs`` after ``--teacher-latency-ms`` per record
(``_sim.serve_teacher``), reached through the teacher stage's ``openai`` backend, each member
holding ``--teacher-concurrency`` records in flight (one GPU teacher's batch). The runs are then
``sync`` (generate, score, annotate, train; annotating with the largest fleet's concurrency, the
barrier's best case) and ``teachers M`` for each M: the streaming stages with M teacher members
(``python -m streamrl teacher``), at the first ``--staleness``. The default teacher (0.1 s per
record, 2 in flight) is the slowest stage with one member (3.2 s of its own per version), and
no longer with two.

With ``--scaled-teachers FAST_MS,SLOW_MS`` (issue 59: several teachers, one per data source) the
prompts take turns between two data sources, each with its own teacher (a simulated server of
that cost per record, ``--teacher-concurrency`` in flight per member), each teacher its own
consumer group from one member, sized on its own lag by ``streamrl run``'s autoscaler
(``run.teacher_autoscale``, up to ``--teacher-max-members``). One run, ``scaled teachers``: per
teacher, its members over time, its lag, the records it annotated, and the ratio of the slow
teacher's mean members to the fast one's (the fleet each needs is ``rate x latency /
concurrency``: the slow teacher's group should grow, the fast one's stay small).

Figures: seconds per version (the steady state: versions after ``--warmup``, so process start-up
and group joins fall on neither side; the streaming stages other than the learner start once it
has announced version 0, so generation gets no head start), ``speedup_vs_sync`` (synchronous over streaming seconds
per version) and ``efficiency_vs_bound``: streaming throughput over the ideal bound, the slowest
stage's own throughput given its concurrency::

    generation = workers * prompts_in_flight * group_size / gen_latency      (trajectories/s)
    judge      = judge_concurrency / mean judge latency
    learner    = mini-batch / step_s
    teacher    = members * teacher_concurrency / teacher_latency          (with --teacher-members)

The default workload is balanced: per version of 64 trajectories (8 prompts x 8 samples),
generation 2.0 s, judge 1.7 s, learner 1.6 s of their own time, so that what the barrier pays for
is each stage idling while the others work, with the judge's long tail on top (a batch waits
for its slowest answers: the synchronous scoring phase takes longer than 64 x mean / concurrency).
Generation runs one prompt at a time so that the groups of a batch reach the judge and the
learner's mini-batches one after another: what lets ``max_staleness`` 1 (one-step off-policy)
overlap all three stages. Last line of stdout: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from streamrl.bench import harness, on_update
from streamrl.bench._sim import Costs, JudgeLatency, SimServer, serve_generation, serve_judge, serve_teacher
from streamrl.bench._stages import configure, run_streaming, run_sync, write_config
from streamrl.datasets import read_rows
from streamrl.feed.prompts import build_prompts
from streamrl.plotting import pyplot, save
from streamrl.reward.config import ScorerSpec

HELP = "streaming pipeline vs a synchronous barrier (time per version, speedup, efficiency vs bound)"

DATASET = "gsm8k"  # GSM8K train (Hugging Face openai/gsm8k through datasets, or its cache)
DATA_SOURCE = "bench"  # what the judge entry serves
#: --scaled-teachers: the two teachers by name, and the data source each serves
SCALED_SOURCES = {"fast": "bench", "slow": "bench_slow"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="a short run (under 2 minutes)",
                                 out="where the JSON, plot and logs go")
    parser.add_argument("--versions", type=int, default=0, help="versions per run (default 12, --quick 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first versions left out of the figures")
    parser.add_argument("--staleness", default="1,2", help="max_staleness of the streaming runs")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-version", type=int, default=8)
    parser.add_argument("--mini-batches", type=int, default=4, help="learner updates per version")
    parser.add_argument("--workers", type=int, default=1, help="rollout workers")
    parser.add_argument("--prompts-in-flight", type=int, default=1, help="per rollout worker")
    parser.add_argument("--gen-latency", type=float, default=0.25, help="seconds per generation request")
    parser.add_argument("--judge-low-ms", type=float, default=10.0)
    parser.add_argument("--judge-high-ms", type=float, default=400.0)
    parser.add_argument("--judge-concurrency", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.4, help="the learner's time per mini-batch update")
    parser.add_argument("--teacher-members", default="",
                        help="teacher group sizes to run, e.g. 1,2,4 (on-policy distillation; default: no teacher)")
    parser.add_argument("--teacher-latency-ms", type=float, default=100.0, help="the teacher's time per record")
    parser.add_argument("--teacher-concurrency", type=int, default=2, help="records in flight per teacher member")
    parser.add_argument("--scaled-teachers", default="", metavar="FAST_MS,SLOW_MS",
                        help="two teachers on two data sources, these costs per record, each group autoscaled on "
                             "its own lag (one run: scaled teachers)")
    parser.add_argument("--teacher-max-members", type=int, default=4, help="--scaled-teachers: each group's most")
    parser.add_argument("--dataset", default=DATASET,
                        help="GSM8K-style dataset: gsm8k (from the hub) or a .jsonl/.parquet file")

    on_update.add_arguments(parser)


@dataclass
class Workload:
    versions: int
    warmup: int
    group_size: int
    groups_per_version: int
    mini_batches: int
    workers: int
    prompts_in_flight: int
    gen_latency_s: float
    judge_low_s: float
    judge_high_s: float
    judge_concurrency: int
    step_s: float
    teacher_latency_s: float = 0.0
    teacher_concurrency: int = 0

    @property
    def batch(self) -> int:
        """Trajectories per version."""
        return self.group_size * self.groups_per_version

    @property
    def groups_per_mini_batch(self) -> int:
        return self.groups_per_version // self.mini_batches

    @property
    def judge(self) -> JudgeLatency:
        return JudgeLatency(self.judge_low_s, self.judge_high_s)

    def bounds(self, teachers: int = 0) -> dict[str, float]:
        """Each stage's own throughput (trajectories/s) given its concurrency (``teachers``
        members of the teacher group, if any); ``bound`` is the slowest."""
        out = {"generation": self.workers * self.prompts_in_flight * self.group_size / self.gen_latency_s,
               "judge": self.judge_concurrency / self.judge.mean,
               "learner": self.groups_per_mini_batch * self.group_size / self.step_s}
        if teachers:
            out["teacher"] = teachers * self.teacher_concurrency / self.teacher_latency_s
        out["bound"] = min(out.values())
        return out


def workload_from(args: argparse.Namespace) -> Workload:
    versions = args.versions or (6 if args.quick else 12)
    if versions <= args.warmup:
        raise SystemExit(f"streamrl bench pipeline: --versions ({versions}) must exceed --warmup ({args.warmup})")
    if args.mini_batches < 1 or args.groups_per_version % args.mini_batches:
        raise SystemExit("streamrl bench pipeline: --groups-per-version must be a multiple of --mini-batches")
    return Workload(versions=versions, warmup=args.warmup, group_size=args.group_size,
                    groups_per_version=args.groups_per_version, mini_batches=args.mini_batches,
                    workers=args.workers,
                    prompts_in_flight=args.prompts_in_flight, gen_latency_s=args.gen_latency,
                    judge_low_s=args.judge_low_ms / 1000, judge_high_s=args.judge_high_ms / 1000,
                    judge_concurrency=args.judge_concurrency, step_s=args.step_s,
                    teacher_latency_s=args.teacher_latency_ms / 1000, teacher_concurrency=args.teacher_concurrency)


def steady_seconds_per_version(ends: dict[int, float], warmup: int, versions: int) -> float:
    """Mean seconds per version from the end of version ``warmup`` to the end of ``versions``."""
    return (ends[versions] - ends[warmup]) / (versions - warmup)


class PipelineBench(harness.Bench):
    """Variants: ``sync``, then ``staleness K`` for each ``--staleness``; one run each."""

    name = "pipeline"
    broker = True

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.w = workload_from(args)
        read_rows(args.dataset, limit=1, field="--dataset")  # a bad name fails now, in one line
        self.stalenesses = [int(s) for s in str(args.staleness).split(",") if s.strip()]
        self.teachers = [int(m) for m in str(args.teacher_members).split(",") if m.strip()]
        if any(m < 1 for m in self.teachers) or (self.teachers and self.w.teacher_concurrency < 1):
            raise SystemExit("streamrl bench pipeline: --teacher-members and --teacher-concurrency must be >= 1")
        self.scaled = [float(m) / 1000 for m in str(args.scaled_teachers).split(",") if m.strip()]
        if self.scaled and (len(self.scaled) != 2 or min(self.scaled) <= 0 or args.teacher_max_members < 1):
            raise SystemExit("streamrl bench pipeline: --scaled-teachers wants FAST_MS,SLOW_MS (> 0), "
                             "--teacher-max-members >= 1")
        if self.scaled:
            self.stalenesses = self.stalenesses[:1]
            self.variants = ["scaled teachers"]
        elif self.teachers:
            self.stalenesses = self.stalenesses[:1]
            self.variants = ["sync"] + [f"teachers {m}" for m in self.teachers]
        else:
            self.variants = ["sync"] + [f"staleness {s}" for s in self.stalenesses]
        self.costs = Costs(step_s=self.w.step_s, following=True, fixed_step=True)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        w = self.w
        with SimServer(serve_generation, w.gen_latency_s) as gen, \
                SimServer(serve_judge, w.judge_low_s, w.judge_high_s) as judge, \
                SimServer(serve_teacher, w.teacher_latency_s) as teacher, contextlib.ExitStack() as stack:
            self.urls = gen.url, judge.url
            self.teacher_url = teacher.url
            self.scaled_urls = [stack.enter_context(SimServer(serve_teacher, s)).url for s in self.scaled]
            yield

    def config(self, staleness: int, run_dir: Path) -> Any:
        """The pipeline config every stage of one run reads (also written as ``pipeline.yaml``)."""
        from streamrl.pipeline_config import PipelineConfig

        w, (gen_url, judge_url) = self.w, self.urls
        cfg = configure(PipelineConfig(), bootstrap=self.bus.bootstrap_servers, run_dir=run_dir, prefix="bench",
                        staleness=staleness, groups=w.groups_per_version, group_size=w.group_size,
                        mini_batches=w.mini_batches, versions=w.versions)
        cfg.feed.dataset, cfg.feed.data_source = self.args.dataset, DATA_SOURCE
        # enough for every version, what the gate lets generation run ahead, and a margin for
        # prompts lost to dead letters
        cfg.feed.limit = (w.versions + max(self.stalenesses, default=1) + 4) * w.groups_per_version + \
            4 * w.workers * w.prompts_in_flight
        r = cfg.rollout
        r.backend, r.openai.base_url, r.openai.model, r.openai.api_key_env = "openai", f"{gen_url}/v1", "sim", ""
        r.openai.timeout_s = 60.0
        r.max_in_flight, r.max_new_tokens = w.prompts_in_flight, 64
        cfg.reward.max_in_flight = 4 * w.batch
        cfg.reward.scorers["bench_judge"] = ScorerSpec(
            type="judge", data_sources=[DATA_SOURCE],
            judge={"urls": [judge_url], "concurrency": w.judge_concurrency, "timeout_s": 30.0,
                   "health_interval_s": 0.0, "max_tokens": 64})
        cfg.learner.group_timeout_s = 120.0
        if self.scaled:  # two teachers, one per data source, each group autoscaled on its own lag
            cfg.distillation.enabled = True
            cfg.reward.scorers["bench_judge"].data_sources = list(SCALED_SOURCES.values())
            cfg.distillation.teacher_models = {
                name: {"key": source, "model_path": "sim", "backend": "openai", "servers": [f"{url}/v1"]}
                for (name, source), url in zip(SCALED_SOURCES.items(), self.scaled_urls)}
            t = cfg.teacher
            t.max_in_flight, t.timeout_s = w.teacher_concurrency, 30.0
            a = cfg.run.teacher_autoscale
            a.min_members, a.max_members = 1, self.args.teacher_max_members
            a.scale_up_lag, a.scale_down_lag, a.window_s, a.cooldown_s = self.teacher_scale_up_lag, 0, 3.0, 6.0
        if self.teachers:  # in line after the reward group (use_task_rewards), the k3 estimator
            cfg.distillation.enabled = True
            t = cfg.teacher
            t.backend, t.model, t.servers = "openai", "sim", [f"{self.teacher_url}/v1"]
            t.max_in_flight, t.timeout_s = w.teacher_concurrency, 30.0
        return cfg

    @property
    def teacher_scale_up_lag(self) -> int:
        """``--scaled-teachers``: more than half a version waiting, for 3 s, adds a member (a
        burst of groups is not a backlog)."""
        return self.w.batch // 2

    async def measure(self, variant: str, round: int) -> dict[str, Any]:
        w = self.w
        run_dir = self.out / "pipeline" / f"{self.stamp}-{variant.replace(' ', '')}"
        if variant == "scaled teachers":
            return await self.measure_scaled(run_dir)
        if variant == "sync":  # first: its batches are every run's prompts
            cfg = self.config(1, run_dir)
            self.prompts = list(build_prompts(cfg.feed))
            out = await run_sync(cfg, self.prompts, self.costs, versions=w.versions,
                                 in_flight=w.workers * w.prompts_in_flight,
                                 teacher_in_flight=max(self.teachers, default=0) * w.teacher_concurrency)
        else:
            teachers = int(variant.split()[-1]) if self.teachers else 0
            cfg = self.config(self.stalenesses[0] if teachers else int(variant.split()[-1]), run_dir)
            sync_s = self.runs["sync"][0]["s_per_version"]
            obs, state = await run_streaming(
                "bench pipeline", cfg, write_config(cfg, run_dir / "pipeline.yaml"), self.prompts, run_dir, self.costs,
                workers=w.workers, teachers=teachers, timeout_s=120 + 3 * w.versions * sync_s,
                settled=lambda obs: obs.latest_version >= w.versions)
            out = {"ends": dict(obs.versions), "trained": state["trained_records"],
                   "deadletters": dict(obs.deadletters)}
        out["s_per_version"] = steady_seconds_per_version(out["ends"], w.warmup, w.versions)
        return out

    async def measure_scaled(self, run_dir: Path) -> dict[str, Any]:
        """Two teachers of different costs on two data sources (the prompts take turns), each
        group from one member, autoscaled on its own lag: each teacher's members and lag over
        the run."""
        import dataclasses

        w = self.w
        cfg = self.config(self.stalenesses[0], run_dir)
        sources = list(SCALED_SOURCES.values())
        prompts = [dataclasses.replace(p, data_source=sources[i % 2]) for i, p in enumerate(build_prompts(cfg.feed))]
        samples: list = []
        obs, state = await run_streaming(
            "bench pipeline", cfg, write_config(cfg, run_dir / "pipeline.yaml"), prompts, run_dir, self.costs,
            workers=w.workers, timeout_s=300 + 10 * w.versions, settled=lambda obs: obs.latest_version >= w.versions,
            scaled_teachers=True, samples=samples)
        per = {}
        for name, latency in zip(SCALED_SOURCES, self.scaled):
            members = [s[name][0] for _, s in samples]
            lags = [s[name][1] for _, s in samples]
            per[name] = {"latency_ms": round(latency * 1000, 1), "members_start": members[0] if members else 0,
                         "members_max": max(members, default=0),
                         "members_mean": round(sum(members) / max(len(members), 1), 3),
                         "lag_mean": round(sum(lags) / max(len(lags), 1), 1), "lag_max": max(lags, default=0),
                         "annotated": obs.distilled_by.get(name, 0),
                         "needed": round(w.batch / 2 / (steady_seconds_per_version(dict(obs.versions), w.warmup,
                                                                                   w.versions))
                                         * latency / w.teacher_concurrency, 2)}
        return {"ends": dict(obs.versions), "trained": state["trained_records"], "deadletters": dict(obs.deadletters),
                "s_per_version": steady_seconds_per_version(dict(obs.versions), w.warmup, w.versions),
                "teachers": per, "samples": samples}

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        if self.scaled:
            (r,) = runs["scaled teachers"]
            fast, slow = (r["teachers"][n] for n in SCALED_SOURCES)
            return {"slow_over_fast_members_mean": round(slow["members_mean"] / max(fast["members_mean"], 1e-9), 3),
                    "teachers": r["teachers"], "s_per_version": round(r["s_per_version"], 3),
                    "trained": r["trained"], "deadletters": sum(r["deadletters"].values()),
                    "members_over_time": r["samples"], "scale_up_lag": self.teacher_scale_up_lag,
                    "workload": asdict(self.w)}
        if self.teachers:
            return self.teacher_summary(runs)
        w, results = self.w, runs.single()
        bounds = w.bounds()
        sync_s = results["sync"]["s_per_version"]
        per_staleness: dict[str, Any] = {}
        for name, r in results.items():
            if name != "sync":
                s = name.split()[-1]
                per_staleness[f"speedup_vs_sync_staleness_{s}"] = round(sync_s / r["s_per_version"], 3)
                per_staleness[f"efficiency_vs_bound_staleness_{s}"] = round(
                    w.batch / r["s_per_version"] / bounds["bound"], 3)
        s1 = str(self.stalenesses[0])
        return {
            "speedup_vs_sync": per_staleness[f"speedup_vs_sync_staleness_{s1}"],
            "efficiency_vs_bound": per_staleness[f"efficiency_vs_bound_staleness_{s1}"],
            "max_staleness": int(s1),
            **per_staleness,
            "sync_s_per_version": round(sync_s, 3),
            "streaming_s_per_version": {n.split()[-1]: round(r["s_per_version"], 3)
                                        for n, r in results.items() if n != "sync"},
            "bound_s_per_version": round(w.batch / bounds["bound"], 3),
            "bounds_per_s": {k: round(v, 3) for k, v in bounds.items()},
            "sync_phases_s": {k: round(v, 3) for k, v in results["sync"]["phases_s"].items()},
            "records": {n if n == "sync" else f"staleness_{n.split()[-1]}": r["trained"] for n, r in results.items()},
            "deadletters": {f"staleness_{n.split()[-1]}": sum(r["deadletters"].values())
                            for n, r in results.items() if n != "sync"},
            "workload": asdict(w),
        }

    def teacher_summary(self, runs: harness.Runs) -> dict[str, Any]:
        """With a teacher: seconds per version by teacher members, against the synchronous loop
        and against each fleet's own bound."""
        w, results = self.w, runs.single()
        sync_s = results["sync"]["s_per_version"]
        per = {m: results[f"teachers {m}"]["s_per_version"] for m in self.teachers}
        bound_s = {m: w.batch / w.bounds(m)["bound"] for m in self.teachers}
        return {
            "teacher_members": self.teachers,
            "max_staleness": self.stalenesses[0],
            "sync_s_per_version": round(sync_s, 3),
            "sync_teacher_members": max(self.teachers),
            "streaming_s_per_version": {str(m): round(s, 3) for m, s in per.items()},
            "speedup_vs_sync": {str(m): round(sync_s / s, 3) for m, s in per.items()},
            "bound_s_per_version": {str(m): round(b, 3) for m, b in bound_s.items()},
            "efficiency_vs_bound": {str(m): round(bound_s[m] / s, 3) for m, s in per.items()},
            "bounds_per_s": {str(m): {k: round(v, 3) for k, v in w.bounds(m).items()} for m in self.teachers},
            "sync_phases_s": {k: round(v, 3) for k, v in results["sync"]["phases_s"].items()},
            "records": {n.replace(" ", "_"): r["trained"] for n, r in results.items()},
            "deadletters": {n.replace(" ", "_"): sum(r["deadletters"].values())
                            for n, r in results.items() if n != "sync"},
            "workload": asdict(w),
        }

    def bounds_of(self, variant: str) -> dict[str, float]:
        """The stage bounds a run is held to (its teacher fleet's, with a teacher)."""
        if not self.teachers:
            return self.w.bounds()
        return self.w.bounds(max(self.teachers) if variant == "sync" else int(variant.split()[-1]))

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        w = self.w
        if self.scaled:
            print(f"two teachers, one per data source, {w.teacher_concurrency} records in flight per member, each "
                  f"group autoscaled on its own lag (1..{self.args.teacher_max_members} members); "
                  f"{w.versions} versions x {w.batch} trajectories, {summary['s_per_version']:.2f} s/version")
            print(harness.table(["teacher", "ms/record", "members start", "max", "mean", "needed", "lag mean",
                                 "lag max", "annotated"],
                                [[n, t["latency_ms"], t["members_start"], t["members_max"], t["members_mean"],
                                  t["needed"], t["lag_mean"], t["lag_max"], t["annotated"]]
                                 for n, t in summary["teachers"].items()]))
            print(f"slow teacher's mean members / fast teacher's: {summary['slow_over_fast_members_mean']}")
            return
        sync_s = runs["sync"][0]["s_per_version"]
        print(f"workload: {w.versions} versions x {w.batch} trajectories; generation {w.gen_latency_s:g} s/request "
              f"x {w.workers * w.prompts_in_flight} prompts in flight; judge log-uniform "
              f"{w.judge_low_s * 1000:g}-{w.judge_high_s * 1000:g} ms (mean {w.judge.mean * 1000:.0f} ms) x "
              f"{w.judge_concurrency}; learner step {w.step_s:g} s")
        if self.teachers:
            print(f"teacher: {w.teacher_latency_s * 1000:g} ms/record x {w.teacher_concurrency} in flight per member; "
                  f"staleness {self.stalenesses[0]}; sync annotates with {max(self.teachers)} members' concurrency")
        for name in runs if self.teachers else ["sync"]:
            print(f"stage bounds (trajectories/s){f' {name}' if self.teachers else ''}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in self.bounds_of(name).items()))
        rows = []
        for name, (r,) in runs.items():
            rate = w.batch / r["s_per_version"]
            rows.append([name, f"{r['s_per_version']:.2f}", f"{rate:.1f}", f"{sync_s / r['s_per_version']:.2f}",
                         f"{rate / self.bounds_of(name)['bound']:.2f}", r["trained"]])
        print(harness.table(["run", "s/version", "traj/s", "speedup", "vs bound", "trained"], rows))
        print("synchronous phases per version (s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in runs["sync"][0]["phases_s"].items()))

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        """Seconds per version for each run against the bound, and versions over time (scaled
        teachers: each teacher group's members and lag over time)."""
        plt = pyplot()
        if self.scaled:
            samples = summary["members_over_time"]
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
            for name, t in summary["teachers"].items():
                ts = [at for at, _ in samples]
                ax1.step(ts, [s[name][0] for _, s in samples], where="post", label=f"{name} ({t['latency_ms']:g} ms)")
                ax2.plot(ts, [s[name][1] for _, s in samples], label=name)
            ax1.set(xlabel="seconds", ylabel="members", title="Each teacher group's members (autoscaled)")
            ax2.set(xlabel="seconds", ylabel="consumer lag (records)", title="Each teacher group's lag")
            for ax in (ax1, ax2):
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            save(fig, path, dpi=80)
            return
        bound_s = self.w.batch / self.bounds_of(list(runs)[-1])["bound"]

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
        names = list(runs)
        values = [runs[n][0]["s_per_version"] for n in names]
        bars = ax1.bar(names, values, color=["#888888"] + ["#3a7dc9"] * (len(names) - 1))
        ax1.bar_label(bars, fmt="%.2f")
        ax1.axhline(bound_s, color="#c0392b", linestyle="--", label=f"ideal bound {bound_s:.2f} s")
        ax1.set(ylabel="seconds per version", title=f"Time per version ({self.w.batch} trajectories)")
        ax1.legend(loc="upper right", fontsize=8)
        for n in names:
            ends = runs[n][0]["ends"]
            t0 = ends[0]
            vs = sorted(ends)
            ax2.plot([ends[v] - t0 for v in vs], vs, marker=".", label=n)
        ax2.set(xlabel="seconds since version 0", ylabel="policy version", title="Versions over time")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
        save(fig, path, dpi=80)


def main(args: argparse.Namespace) -> int:
    if args.on_update:  # what a weight update costs the rollout server, by on_update (``on_update``)
        from streamrl.bench.on_update import OnUpdateBench

        return harness.run(OnUpdateBench(args))
    return harness.run(PipelineBench(args))
