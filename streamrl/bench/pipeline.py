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

Figures: seconds per version (the steady state: versions after ``--warmup``, so process start-up
and group joins fall on neither side; the streaming stages other than the learner start once it
has announced version 0, so generation gets no head start), ``speedup_vs_sync`` (synchronous over streaming seconds
per version) and ``efficiency_vs_bound``: streaming throughput over the ideal bound, the slowest
stage's own throughput given its concurrency::

    generation = workers * prompts_in_flight * group_size / gen_latency      (trajectories/s)
    judge      = judge_concurrency / mean judge latency
    learner    = mini-batch / step_s

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
import asyncio
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamrl.bench._sim import JudgeLatency
from streamrl.plotting import pyplot, save

HELP = "streaming pipeline vs a synchronous barrier (time per version, speedup, efficiency vs bound)"

DATASET = "gsm8k"  # GSM8K train (Hugging Face openai/gsm8k through datasets, or its cache)
DATA_SOURCE = "bench"  # what the judge entry serves


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from streamrl.commands.common import add_bootstrap_argument

    add_bootstrap_argument(parser)
    parser.add_argument("--quick", action="store_true", help="a short run (under 2 minutes)")
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
    parser.add_argument("--dataset", default=DATASET,
                        help="GSM8K-style dataset: gsm8k (from the hub) or a .jsonl/.parquet file")
    parser.add_argument("--out", default="runs/bench", help="where the JSON, plot and logs go")


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

    def bounds(self) -> dict[str, float]:
        """Each stage's own throughput (trajectories/s) given its concurrency; ``bound`` is the
        slowest."""
        out = {"generation": self.workers * self.prompts_in_flight * self.group_size / self.gen_latency_s,
               "judge": self.judge_concurrency / self.judge.mean,
               "learner": self.groups_per_mini_batch * self.group_size / self.step_s}
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
                    judge_concurrency=args.judge_concurrency, step_s=args.step_s)


def pipeline_config(w: Workload, bootstrap: str, gen_url: str, judge_url: str, staleness: int,
                    run_dir: Path, dataset: str):
    """The pipeline config every stage of one run reads (also written as ``pipeline.yaml``)."""
    from streamrl.pipeline_config import PipelineConfig
    from streamrl.reward.config import ScorerSpec

    run_id = run_dir.name
    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = bootstrap
    cfg.bus.topic_prefix = f"bench{uuid.uuid4().hex[:8]}"
    cfg.feed.dataset, cfg.feed.data_source, cfg.feed.group_size = dataset, DATA_SOURCE, w.group_size
    cfg.feed.shuffle = False
    r = cfg.rollout
    r.backend, r.openai.base_url, r.openai.model, r.openai.api_key_env = "openai", f"{gen_url}/v1", "sim", ""
    r.openai.timeout_s = 60.0
    r.group = f"{run_id}-rollout"
    r.max_in_flight, r.max_new_tokens = w.prompts_in_flight, 64
    r.max_staleness, r.trajectories_per_version, r.gate_poll_s = staleness, w.batch, 0.1
    cfg.reward.group = f"{run_id}-reward"
    cfg.reward.max_in_flight = 4 * w.batch
    cfg.reward.scorers["bench_judge"] = ScorerSpec(
        type="judge", data_sources=[DATA_SOURCE],
        judge={"urls": [judge_url], "concurrency": w.judge_concurrency, "timeout_s": 30.0,
               "health_interval_s": 0.0, "max_tokens": 64})
    lc = cfg.learner
    lc.max_staleness, lc.groups_per_mini_batch = staleness, w.groups_per_mini_batch
    lc.mini_batches_per_version = w.mini_batches
    lc.versions, lc.consumer_group = w.versions, f"{run_id}-learner"
    # no checkpoint inside the measured versions (verl checkpoints every N steps, and the
    # synchronous side writes none): the learner writes its one checkpoint as it stops
    lc.checkpoint_every = w.versions + 1
    lc.checkpoint_dir, lc.weights_dir = str(run_dir / "checkpoints"), str(run_dir / "weights")
    lc.group_timeout_s = 120.0
    return cfg


def write_config(cfg, path: Path) -> Path:
    from streamrl.config import to_yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def steady_seconds_per_version(ends: dict[int, float], warmup: int, versions: int) -> float:
    """Mean seconds per version from the end of version ``warmup`` to the end of ``versions``."""
    return (ends[versions] - ends[warmup]) / (versions - warmup)


# -- (a) synchronous -----------------------------------------------------------------------------

async def bounded(limit: int, calls: list) -> list:
    """``calls`` awaited with at most ``limit`` at once: the synchronous loops pay the stages'
    own in-flight limits (prompts per worker, records per reward member), so each side pays the
    fixed latencies with the same concurrency."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> Any:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def run_sync(w: Workload, cfg, prompts: list, weights_dir: Path) -> dict[str, Any]:
    """Generate a batch, score all of it, train, publish the weights; ``versions`` times."""
    from streamrl.bench._sim import FixedStepTrainer, FollowingBackend
    from streamrl.learner.samples import to_samples
    from streamrl.learner.trainer import Trainer
    from streamrl.policy import save_policy
    from streamrl.reward.scoring import Scoring
    from streamrl.rollout.backends import SamplingParams
    from streamrl.rollout.chat import ChatRenderer
    from streamrl.rollout.episode import run_group
    from transformers.utils import logging as transformers_logging

    o = cfg.rollout.openai
    backend = FollowingBackend(o.base_url, o.model, api_key_env="", timeout_s=o.timeout_s,
                               max_retries=o.max_retries)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
    renderer = ChatRenderer(backend.tokenizer)
    reward = Scoring(cfg.reward)
    await reward.start()
    trainer = FixedStepTrainer(Trainer(cfg.learner), w.step_s)
    transformers_logging.disable_progress_bar()

    phases = {"generate": 0.0, "score": 0.0, "train": 0.0}
    trained = 0
    try:
        ends = {0: time.time()}
        for v in range(w.versions):
            t0 = time.time()
            batch = prompts[v * w.groups_per_version:(v + 1) * w.groups_per_version]
            groups = await bounded(w.workers * w.prompts_in_flight,
                                   [run_group(p, w.group_size, backend, params, renderer) for p in batch])
            trajectories = [t for group in groups for t in group]
            t1 = time.time()
            rewarded = await asyncio.gather(*map(reward.reward, trajectories))
            t2 = time.time()
            samples = to_samples(rewarded, cfg.learner, trainer)
            per = w.groups_per_mini_batch * w.group_size
            for i in range(0, len(samples), per):
                await asyncio.to_thread(trainer.step, samples[i:i + per])
            path = await asyncio.to_thread(save_policy, trainer.model, trainer.tokenizer,
                                           weights_dir / f"v{v + 1}")
            await backend.load_weights(str(path), v + 1)
            ends[v + 1] = t3 = time.time()
            trained += len(samples)
            for name, took in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name] += took
    finally:
        await reward.close()
        await backend.close()
    return {"ends": ends, "trained": trained, "phases_s": {k: v / w.versions for k, v in phases.items()}}


# -- (b) streaming -------------------------------------------------------------------------------

def _child_setup(log_path: str) -> None:
    """A stage process writes its output to its own log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _rollout_process(cfg_path: str, log_path: str) -> None:
    _child_setup(log_path)
    from streamrl.bench._sim import FollowingBackend
    from streamrl.bus import Bus
    from streamrl.runtime import run_until_signalled
    from streamrl.pipeline_config import load_config
    from streamrl.rollout.worker import RolloutWorker

    cfg = load_config(cfg_path)
    o = cfg.rollout.openai

    async def main(stop: asyncio.Event) -> None:
        backend = FollowingBackend(o.base_url, o.model, api_key_env="", timeout_s=o.timeout_s,
                                   max_retries=o.max_retries)
        await RolloutWorker(Bus(cfg.bus), cfg.rollout, backend).run(stop)

    run_until_signalled(main)


def _learner_process(cfg_path: str, log_path: str, step_s: float, state_path: str) -> None:
    _child_setup(log_path)
    from streamrl.bench._sim import FixedStepTrainer
    from streamrl.bus import Bus
    from streamrl.runtime import run_until_signalled
    from streamrl.pipeline_config import load_config
    from streamrl.learner.stage import Learner

    cfg = load_config(cfg_path)

    async def main(stop: asyncio.Event) -> None:
        learner = Learner(Bus(cfg.bus), cfg.learner)
        learner.trainer = FixedStepTrainer(learner.trainer, step_s)
        state = await learner.run(stop)
        Path(state_path).write_text(json.dumps({"version": state.version, "trained_records": state.trained_records,
                                                "consumed_records": state.consumed_records}))

    run_until_signalled(main)


async def start_stages(bench: str, bus, observer, learner, reward, rollouts: list, cfg_path: Path,
                       prompts: list, logs: Path, learner_start_s: float) -> None:
    """Start a bench's real stages in the order that keeps the clock honest: the learner, then
    (once it has announced version 0) a reward member and the rollout processes, then the
    prompts. Also ``streamrl.bench.learning``'s start."""
    learner.start()
    deadline = time.monotonic() + learner_start_s
    while 0 not in (await observer.poll(timeout_ms=200)).versions:
        if learner.exitcode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{bench}: the learner did not start; see {logs}")
    reward.start("reward-0", ["reward", "--config", str(cfg_path), "--bootstrap-servers",
                              bus.config.bootstrap_servers, "metrics.port=0"], "reward")
    for p in rollouts:
        p.start()
    async with bus.producer("bench") as producer:
        await asyncio.gather(*[await producer.send(p) for p in prompts])


async def run_streaming(w: Workload, cfg, cfg_path: Path, prompts: list, run_dir: Path,
                        timeout_s: float) -> dict[str, Any]:
    """The real stages as processes; the clock is the learner's version announcements."""
    from streamrl.bus import Bus
    from streamrl.config import RestartConfig
    from streamrl.launching import LocalLauncher
    from streamrl.observing import Observer
    from streamrl.topics import ensure_topics

    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "learner_state.json"
    ctx = mp.get_context("spawn")
    learner = ctx.Process(target=_learner_process, daemon=True,
                          args=(str(cfg_path), str(logs / "learner.log"), w.step_s, str(state_path)))
    rollouts = [ctx.Process(target=_rollout_process, daemon=True,
                            args=(str(cfg_path), str(logs / f"rollout-{i}.log"))) for i in range(w.workers)]
    reward = LocalLauncher(logs, RestartConfig(max_restarts=0))  # a crash fails the bench
    observer = Observer(bus)
    await observer.start()
    try:
        # The learner first, and the others once it has announced version 0 (its model is built
        # and its consumer started): otherwise generation starts seconds ahead of it, and the
        # backlog it builds would flatter the first measured versions.
        await start_stages("bench pipeline", bus, observer, learner, reward, rollouts, cfg_path, prompts, logs, 120)
        deadline = time.monotonic() + timeout_s
        while True:
            obs = await observer.poll(timeout_ms=200)
            if learner.exitcode is not None:
                break
            broken = reward.failed() or next((f"rollout-{i}" for i, p in enumerate(rollouts)
                                              if p.exitcode is not None), None)
            if broken:
                raise RuntimeError(f"bench pipeline: stage {broken} exited early; logs in {logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench pipeline: no version {w.versions} within {timeout_s:.0f}s "
                                   f"(at {obs.latest_version}); logs in {logs}")
        if learner.exitcode != 0:
            raise RuntimeError(f"bench pipeline: the learner exited with {learner.exitcode}; see {logs}")
        for _ in range(50):  # the last announcement reaches the topic before the learner exits
            if (await observer.poll(timeout_ms=100)).latest_version >= w.versions:
                break
    finally:
        await asyncio.to_thread(reward.stop_all, 15.0)
        for p in [*rollouts, learner]:
            if p.is_alive():
                p.terminate()
            await asyncio.to_thread(p.join, 15)
            if p.is_alive():
                p.kill()
        await observer.stop()
    obs = observer.obs
    state = json.loads(state_path.read_text())
    return {"ends": dict(obs.versions), "trained": state["trained_records"],
            "rewarded": obs.rewarded, "rollouts": obs.rollouts,
            "deadletters": dict(obs.deadletters)}


# -- the whole bench -----------------------------------------------------------------------------

def plot(results: dict[str, dict[str, Any]], w: Workload, bound_s: float, path: Path) -> None:
    """Seconds per version for each run against the bound, and versions over time."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    values = [results[n]["s_per_version"] for n in names]
    bars = ax1.bar(names, values, color=["#888888"] + ["#3a7dc9"] * (len(names) - 1))
    ax1.bar_label(bars, fmt="%.2f")
    ax1.axhline(bound_s, color="#c0392b", linestyle="--", label=f"ideal bound {bound_s:.2f} s")
    ax1.set(ylabel="seconds per version", title=f"Time per version ({w.batch} trajectories)")
    ax1.legend(loc="upper right", fontsize=8)
    for n in names:
        ends = results[n]["ends"]
        t0 = ends[0]
        vs = sorted(ends)
        ax2.plot([ends[v] - t0 for v in vs], vs, marker=".", label=n)
    ax2.set(xlabel="seconds since version 0", ylabel="policy version", title="Versions over time")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    save(fig, path, dpi=80)


async def _bench(args: argparse.Namespace, w: Workload, bootstrap: str, out: Path) -> dict[str, Any]:
    from streamrl.bench._sim import SimServer, serve_generation, serve_judge
    from streamrl.rollout.feed import build_prompts

    stalenesses = [int(s) for s in str(args.staleness).split(",") if s.strip()]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with SimServer(serve_generation, w.gen_latency_s) as gen, \
            SimServer(serve_judge, w.judge_low_s, w.judge_high_s) as judge:
        results: dict[str, dict[str, Any]] = {}
        run_dir = out / "pipeline" / f"{stamp}-sync"
        cfg = pipeline_config(w, bootstrap, gen.url, judge.url, 1, run_dir, args.dataset)
        # enough for every version, what the gate lets generation run ahead, and a margin for
        # prompts lost to dead letters
        cfg.feed.limit = (w.versions + max(stalenesses, default=1) + 4) * w.groups_per_version + \
            4 * w.workers * w.prompts_in_flight
        prompts = list(build_prompts(cfg.feed))
        print(f"bench pipeline: {w.versions} versions of {w.batch} trajectories; synchronous ...",
              file=sys.stderr, flush=True)
        results["sync"] = await run_sync(w, cfg, prompts, run_dir / "weights")
        for s in stalenesses:
            print(f"bench pipeline: streaming, max_staleness {s} ...", file=sys.stderr, flush=True)
            run_dir = out / "pipeline" / f"{stamp}-staleness{s}"
            cfg = pipeline_config(w, bootstrap, gen.url, judge.url, s, run_dir, args.dataset)
            cfg_path = write_config(cfg, run_dir / "pipeline.yaml")
            sync_s = steady_seconds_per_version(results["sync"]["ends"], w.warmup, w.versions)
            results[f"staleness {s}"] = await run_streaming(
                w, cfg, cfg_path, prompts, run_dir, timeout_s=120 + 3 * w.versions * sync_s)
    return results


def main(args: argparse.Namespace) -> int:
    from streamrl.runtime import broker_for
    from streamrl.pipeline_config import PipelineConfig

    from streamrl.datasets import read_rows

    w = workload_from(args)
    read_rows(args.dataset, limit=1, field="--dataset")  # a bad name fails now, in one line
    out = Path(args.out)
    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = args.bootstrap_servers
    started = time.monotonic()
    with broker_for(cfg) as bootstrap:
        results = asyncio.run(_bench(args, w, bootstrap, out))
    bounds = w.bounds()
    bound_s = w.batch / bounds["bound"]
    for r in results.values():
        r["s_per_version"] = steady_seconds_per_version(r["ends"], w.warmup, w.versions)
    sync_s = results["sync"]["s_per_version"]
    plot_path = out / "pipeline.png"
    plot(results, w, bound_s, plot_path)

    print(f"workload: {w.versions} versions x {w.batch} trajectories; generation {w.gen_latency_s:g} s/request "
          f"x {w.workers * w.prompts_in_flight} prompts in flight; judge log-uniform "
          f"{w.judge_low_s * 1000:g}-{w.judge_high_s * 1000:g} ms (mean {w.judge.mean * 1000:.0f} ms) x "
          f"{w.judge_concurrency}; learner step {w.step_s:g} s")
    print("stage bounds (trajectories/s): " + ", ".join(f"{k} {v:.1f}" for k, v in bounds.items()))
    print(f"{'run':14s} {'s/version':>10s} {'traj/s':>8s} {'speedup':>8s} {'vs bound':>9s} {'trained':>8s}")
    summary: dict[str, Any] = {}
    for name, r in results.items():
        rate = w.batch / r["s_per_version"]
        speedup, eff = sync_s / r["s_per_version"], rate / bounds["bound"]
        print(f"{name:14s} {r['s_per_version']:10.2f} {rate:8.1f} {speedup:8.2f} {eff:9.2f} {r['trained']:8d}")
        if name != "sync":
            s = name.split()[-1]
            summary[f"speedup_vs_sync_staleness_{s}"] = round(speedup, 3)
            summary[f"efficiency_vs_bound_staleness_{s}"] = round(eff, 3)
    print("synchronous phases per version (s): " + ", ".join(
        f"{k} {v:.2f}" for k, v in results["sync"]["phases_s"].items()))
    first = next(n for n in results if n != "sync")
    s1 = first.split()[-1]
    result = {
        "speedup_vs_sync": summary[f"speedup_vs_sync_staleness_{s1}"],
        "efficiency_vs_bound": summary[f"efficiency_vs_bound_staleness_{s1}"],
        "max_staleness": int(s1),
        **summary,
        "sync_s_per_version": round(sync_s, 3),
        "streaming_s_per_version": {n.split()[-1]: round(r["s_per_version"], 3)
                                    for n, r in results.items() if n != "sync"},
        "bound_s_per_version": round(bound_s, 3),
        "bounds_per_s": {k: round(v, 3) for k, v in bounds.items()},
        "sync_phases_s": {k: round(v, 3) for k, v in results["sync"]["phases_s"].items()},
        "records": {n if n == "sync" else f"staleness_{n.split()[-1]}": r["trained"] for n, r in results.items()},
        "deadletters": {f"staleness_{n.split()[-1]}": sum(r["deadletters"].values())
                        for n, r in results.items() if n != "sync"},
        "workload": asdict(w),
        "seconds": round(time.monotonic() - started, 1),
        "plot": str(plot_path),
    }
    (out / "pipeline.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0
