"""``streamrl bench learning``: does streaming reach the reward synchronous training reaches, and
how much sooner? Time to reward with real learner updates.

One task, seed and sample budget: the generated ``digits:rev`` task (reverse two digits: the
embedded default's generator, scorer and warm-started tiny policy; ``--task digits`` for the
default's ``inc``, which needs twice the versions), ``--versions`` versions of ``--groups`` x
``--group-size`` trajectories, trained:

(a) **synchronously**, as verl's default trainer: generate a batch, score all of it, train on
    it, publish the weights, repeat. In this process, with the same components as the stages:
    the rollout ``run_group`` over the transformers backend, the reward stage's ``Scoring``,
    the learner's ``Trainer`` and weight writer;
(b) **streaming** through the real stages, each its own process (rollout worker, reward group
    member through the CLI, learner), at ``max_staleness`` 1, 2 and 4, each with the off-policy
    correction (``learner.decoupled``: AReaL's decoupled PPO, the importance weight against the
    behaviour policy truncated at ``is_cap``) off and on.

Every update is the real ``Trainer.step``. Fixed latencies (documented, the same on both sides)
stand in for what a GPU cluster has and two shared CPU cores hide: ``--gen-latency`` seconds
added to each generation call (one prompt's group), ``--judge-latency`` to each score,
``--step-latency`` to each learner step. Both sides pay them with the same concurrency, the
stages' own limits (a version's prompts in flight at once, ``reward.max_in_flight`` records),
so by default a version costs 1 s of generation, 0.5 s of judging and 1 s of training on top
of its real work: a GPU run whose generation and update take about as long, with an LLM judge.
With them at 0 the bench measures this machine, where all stages compete for two cores.

Per variant and seed: reward by version (the mean over the records that version generated),
against wall time (from the run's first score) and against trained samples; the wall time and
the samples to reach ``--target``; the final reward (mean of the last ``--final`` versions).
Across seeds: mean and spread (min..max). One plot (reward against time and against samples)
and, as the last line of stdout, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from streamrl.bench.pipeline import bounded
from streamrl.plotting import pyplot, save

HELP = "time to reward: synchronous vs streaming (max_staleness 1/2/4, correction off/on), real learner updates"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from streamrl.commands.common import add_bootstrap_argument

    add_bootstrap_argument(parser)
    parser.add_argument("--quick", action="store_true",
                        help="one seed, staleness 1 with the correction, 20 versions, target 0.15 (under 3 minutes)")
    parser.add_argument("--task", default="digits:rev",
                        help="the generated task (digits[:OP]); the seed is appended (default: reverse two digits)")
    parser.add_argument("--versions", type=int, default=0, help="versions per run (default 40, --quick 20)")
    parser.add_argument("--seeds", type=int, default=0, help="seeds per variant (default 3, --quick 1)")
    parser.add_argument("--staleness", default="", help="streaming max_staleness values (default 1,2,4; --quick 1)")
    parser.add_argument("--correction", default="",
                        help="the off-policy correction in the streaming runs: off,on (default both; --quick on)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per version")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.0, help="learning rate (default: local.yaml's)")
    parser.add_argument("--target", type=float, default=0.0, help="reward to reach (default 0.4, --quick 0.15)")
    parser.add_argument("--final", type=int, default=5, help="the final reward: mean of this many last versions")
    parser.add_argument("--gen-latency", type=float, default=1.0,
                        help="seconds added to each generation call (one prompt's group; a version's prompts are in flight at once)")
    parser.add_argument("--judge-latency", type=float, default=0.5, help="seconds added to each score (a judge's round trip)")
    parser.add_argument("--step-latency", type=float, default=1.0, help="seconds added to each learner step (one per version)")
    parser.add_argument("--out", default="runs/bench", help="where the runs, JSON and plot go")


@dataclass
class Setup:
    task: str
    versions: int
    seeds: int
    staleness: list[int]
    corrections: list[bool]
    groups: int
    group_size: int
    lr: float
    target: float
    final: int
    gen_latency_s: float
    judge_latency_s: float
    step_latency_s: float

    @property
    def batch(self) -> int:
        return self.groups * self.group_size


def setup_from(args: argparse.Namespace) -> Setup:
    staleness = [int(s) for s in (args.staleness or ("1" if args.quick else "1,2,4")).split(",") if s.strip()]
    words = [w.strip() for w in (args.correction or ("on" if args.quick else "off,on")).split(",")]
    if not set(words) <= {"off", "on"}:
        raise SystemExit(f"bench learning: --correction takes off, on or off,on (got {args.correction!r})")
    return Setup(task=args.task, versions=args.versions or (20 if args.quick else 40),
                 seeds=args.seeds or (1 if args.quick else 3), staleness=staleness,
                 corrections=[w == "on" for w in words], groups=args.groups, group_size=args.group_size,
                 lr=args.lr, target=args.target or (0.15 if args.quick else 0.4), final=args.final,
                 gen_latency_s=args.gen_latency, judge_latency_s=args.judge_latency,
                 step_latency_s=args.step_latency)


# -- the fixed latencies --------------------------------------------------------------------------

async def score_after(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                      latency_s: float = 0.0) -> dict[str, Any]:
    """The digits rule, answered after ``latency_s`` (a judge's round trip)."""
    from streamrl.scorers.digits import compute_score

    if latency_s:
        await asyncio.sleep(latency_s)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def latency_backend(cfg: Any, latency_s: float) -> Any:
    """The rollout config's transformers backend, each ``generate`` call answered ``latency_s``
    later than its real work."""
    from streamrl.rollout.backends import make_backend

    backend = make_backend(cfg)
    if latency_s:
        real = backend.generate

        async def generate(prompts: Sequence[Any], n: int, params: Any) -> Any:
            out = await real(prompts, n, params)
            await asyncio.sleep(latency_s)
            return out

        backend.generate = generate
    return backend


class LatencyTrainer:
    """The real ``Trainer``; each step returns ``latency_s`` after its real update."""

    def __init__(self, trainer: Any, latency_s: float):
        self._trainer, self.latency_s = trainer, latency_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def step(self, samples: Sequence[Any]) -> dict[str, float]:
        out = self._trainer.step(samples)
        time.sleep(self.latency_s)
        return out


# -- one run's config -----------------------------------------------------------------------------

def run_config(s: Setup, bootstrap: str, run_dir: Path, policy: str, seed: int, staleness: int,
               correction: bool) -> Any:
    import uuid

    from streamrl.pipeline_config import load_config
    from streamrl.reward.config import ScorerSpec

    cfg = load_config("local.yaml")  # the embedded default's task, prompts and sampling
    cfg.bus.bootstrap_servers = bootstrap
    cfg.bus.topic_prefix = f"learn{uuid.uuid4().hex[:8]}"
    run_id = run_dir.name
    cfg.feed.dataset, cfg.feed.group_size, cfg.feed.shuffle = f"{s.task}@{seed}", s.group_size, False
    cfg.feed.limit = (s.versions + 8) * s.groups
    r = cfg.rollout
    r.policy, r.seed, r.group = policy, seed, f"{run_id}-rollout"
    r.max_staleness, r.trajectories_per_version, r.gate_poll_s = staleness, s.batch, 0.1
    r.max_in_flight = s.groups  # a version's prompts in flight at once, as a serving engine takes a batch
    cfg.reward.group = f"{run_id}-reward"
    cfg.reward.scorers["digits"] = ScorerSpec(type="function", path="streamrl.bench.learning:score_after",
                                              kwargs={"latency_s": s.judge_latency_s}, data_sources=["digits"])
    lc = cfg.learner
    lc.policy, lc.seed, lc.lr, lc.decoupled = policy, seed, s.lr or lc.lr, correction
    lc.max_staleness, lc.groups_per_mini_batch, lc.mini_batches_per_version = staleness, s.groups, 1
    lc.versions, lc.consumer_group = s.versions, f"{run_id}-learner"
    lc.checkpoint_every = s.versions + 1  # one checkpoint, as it stops
    lc.checkpoint_dir, lc.weights_dir = str(run_dir / "checkpoints"), str(run_dir / "weights")
    return cfg


# -- (a) synchronous ------------------------------------------------------------------------------

async def run_sync(s: Setup, cfg: Any, prompts: list) -> dict[str, Any]:
    """Generate a batch, score all of it, train, publish; ``versions`` times. Returns the
    reward of each version's batch and when each version was published."""
    from streamrl.learner.samples import to_samples
    from streamrl.learner.trainer import Trainer
    from streamrl.policy import save_policy
    from streamrl.reward.scoring import Scoring
    from streamrl.rollout.backends import SamplingParams
    from streamrl.rollout.chat import ChatRenderer
    from streamrl.rollout.episode import run_group

    backend = latency_backend(cfg.rollout, s.gen_latency_s)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
    renderer = ChatRenderer(backend.tokenizer)
    reward = Scoring(cfg.reward)
    await reward.start()
    trainer = LatencyTrainer(Trainer(cfg.learner), s.step_latency_s)
    weights = Path(cfg.learner.weights_dir)
    weights.mkdir(parents=True, exist_ok=True)
    rewards: dict[int, float] = {}
    seen: dict[int, float] = {}
    first: list[float] = []

    async def score(t: Any) -> Any:
        out = await reward.reward(t)
        first.append(time.time())
        return out

    try:
        for v in range(s.versions):
            batch = prompts[v * s.groups:(v + 1) * s.groups]
            groups = await bounded(cfg.rollout.max_in_flight,
                                   [run_group(p, s.group_size, backend, params, renderer) for p in batch])
            scored = await bounded(cfg.reward.max_in_flight, [score(t) for g in groups for t in g])
            rewards[v], seen[v] = statistics.fmean(float(r.reward) for r in scored), time.time()
            await asyncio.to_thread(trainer.step, to_samples(scored, cfg.learner, trainer))
            path = await asyncio.to_thread(save_policy, trainer.model, trainer.tokenizer, weights / f"v{v + 1}")
            await backend.load_weights(str(path), v + 1)
    finally:
        await reward.close()
        await backend.close()
    return {"rewards": rewards, "seen": {v: t - min(first) for v, t in seen.items()}}


# -- (b) streaming --------------------------------------------------------------------------------

def _rollout_process(cfg_path: str, log_path: str, latency_s: float) -> None:
    from streamrl.bench.pipeline import _child_setup

    _child_setup(log_path)
    from streamrl.bus import Bus
    from streamrl.runtime import run_until_signalled
    from streamrl.pipeline_config import load_config
    from streamrl.rollout.worker import RolloutWorker

    cfg = load_config(cfg_path)

    async def main(stop: asyncio.Event) -> None:
        await RolloutWorker(Bus(cfg.bus), cfg.rollout, latency_backend(cfg.rollout, latency_s)).run(stop)

    run_until_signalled(main)


def _learner_process(cfg_path: str, log_path: str, latency_s: float) -> None:
    from streamrl.bench.pipeline import _child_setup

    _child_setup(log_path)
    from streamrl.bus import Bus
    from streamrl.runtime import run_until_signalled
    from streamrl.pipeline_config import load_config
    from streamrl.learner.stage import Learner

    cfg = load_config(cfg_path)

    async def main(stop: asyncio.Event) -> None:
        learner = Learner(Bus(cfg.bus), cfg.learner)
        learner.trainer = LatencyTrainer(learner.trainer, latency_s)
        await learner.run(stop)

    run_until_signalled(main)


async def run_streaming(s: Setup, cfg: Any, cfg_path: Path, prompts: list, run_dir: Path) -> dict[str, Any]:
    """The real stages as processes (started as ``bench pipeline`` starts them: the learner
    first, the rest once it has announced version 0); rewards and version times from the
    topics, through the run's ``Observer``."""
    from streamrl.bench.pipeline import start_stages
    from streamrl.bus import Bus
    from streamrl.config import RestartConfig
    from streamrl.launching import LocalLauncher
    from streamrl.observing import Observer
    from streamrl.topics import ensure_topics

    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    learner = ctx.Process(target=_learner_process, daemon=True,
                          args=(str(cfg_path), str(logs / "learner.log"), s.step_latency_s))
    rollout = ctx.Process(target=_rollout_process, daemon=True,
                          args=(str(cfg_path), str(logs / "rollout.log"), s.gen_latency_s))
    reward = LocalLauncher(logs, RestartConfig(max_restarts=0))
    observer = Observer(bus)
    await observer.start()
    try:
        await start_stages("bench learning", bus, observer, learner, reward, [rollout], cfg_path, prompts, logs, 180)
        deadline = time.monotonic() + 60 + 10 * s.versions
        while learner.exitcode is None:
            obs = await observer.poll(timeout_ms=200)
            if reward.failed() or rollout.exitcode is not None:
                raise RuntimeError(f"bench learning: a stage exited early; logs in {logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench learning: no version {s.versions} in time (at {obs.latest_version}); "
                                   f"logs in {logs}")
        if learner.exitcode != 0:
            raise RuntimeError(f"bench learning: the learner exited with {learner.exitcode}; see {logs}")
        # the records the last versions generated are still being scored: a moment for them
        for _ in range(30):
            obs = await observer.poll(timeout_ms=100)
            if obs.latest_version >= s.versions and obs.by_version.get(s.versions - 1) is not None \
                    and obs.by_version[s.versions - 1].records >= s.batch:
                break
    finally:
        await asyncio.to_thread(reward.stop_all, 15.0)
        for p in (rollout, learner):
            if p.is_alive():
                p.terminate()
            await asyncio.to_thread(p.join, 15)
            if p.is_alive():
                p.kill()
        await observer.stop()
    obs = observer.obs
    done = {v: st for v, st in obs.by_version.items() if st.records and v < s.versions}
    t0 = min(st.first_scored for st in done.values())
    return {"rewards": {v: st.mean for v, st in done.items()},
            "seen": {v: st.last_scored - t0 for v, st in done.items()},
            "deadletters": sum(obs.deadletters.values())}


# -- figures --------------------------------------------------------------------------------------

def curve(run: dict[str, Any], batch: int) -> list[tuple[int, float, int, float]]:
    """``(version, seconds, trained samples, reward)``: the mean reward of the records version
    v generated, the policy trained on ``v * batch`` samples, all of them scored ``seconds``
    after the run's first score (the clock starts there on both sides, so process start-up and
    model loading count on neither)."""
    return [(v, run["seen"][v], v * batch, r) for v, r in sorted(run["rewards"].items())]


def reach(points: list[tuple[int, float, int, float]], target: float) -> tuple[float | None, int | None]:
    """Seconds and samples until a version's reward first reaches ``target`` (None: never)."""
    for _, seconds, samples, r in points:
        if r >= target:
            return seconds, samples
    return None, None


def summarise(runs: list[dict[str, Any]], s: Setup) -> dict[str, Any]:
    """One variant over its seeds."""
    finals, times, samples = [], [], []
    for run in runs:
        pts = curve(run, s.batch)
        finals.append(statistics.fmean(r for *_, r in pts[-s.final:]))
        t, n = reach(pts, s.target)
        times.append(t)
        samples.append(n)
    reached = [t for t in times if t is not None]
    return {"final_reward": round(statistics.fmean(finals), 4), "final_min": round(min(finals), 4),
            "final_max": round(max(finals), 4), "final_by_seed": [round(f, 4) for f in finals],
            "seconds_to_target": round(statistics.fmean(reached), 2) if len(reached) == len(runs) else None,
            "samples_to_target": (round(statistics.fmean([n for n in samples if n is not None]))
                                  if len(reached) == len(runs) else None),
            "reached": f"{len(reached)}/{len(runs)}",
            # trajectories dead-lettered on the way (streaming: mostly groups the learner found
            # older than max_staleness): generated, never trained
            "dead_lettered": round(statistics.fmean(r.get("deadletters", 0) for r in runs)),
            "seconds": round(statistics.fmean(max(r["seen"].values()) for r in runs), 2)}


def plot(results: dict[str, list[dict[str, Any]]], s: Setup, path: Path) -> Path:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, runs) in enumerate(results.items()):
        color = "#333333" if name == "sync" else plt.get_cmap("tab10")(i)
        style = "--" if name.endswith("correction") else "-"
        for j, run in enumerate(runs):
            pts = curve(run, s.batch)
            label = name if j == 0 else None
            ax1.plot([p[1] for p in pts], [p[3] for p in pts], style, color=color, alpha=0.8, lw=1.2, label=label)
            ax2.plot([p[2] for p in pts], [p[3] for p in pts], style, color=color, alpha=0.8, lw=1.2, label=label)
    for ax, xlabel in ((ax1, "seconds since version 0"), (ax2, "trained samples")):
        ax.axhline(s.target, color="#c0392b", lw=0.8, ls=":")
        ax.set(xlabel=xlabel, ylabel="mean reward (records of the version)")
        ax.grid(alpha=0.3)
    ax1.set_title("Reward against wall time")
    ax2.set_title("Reward against trained samples")
    ax2.legend(fontsize=7)
    return save(fig, path, dpi=90)


# -- the whole bench ------------------------------------------------------------------------------

async def _bench(s: Setup, bootstrap: str, out: Path) -> dict[str, list[dict[str, Any]]]:
    from streamrl.bench.pipeline import write_config
    from streamrl.rollout.feed import build_prompts
    from streamrl.tasks import digits

    stamp = time.strftime("%Y%m%d-%H%M%S")
    variants = [("sync", 0, False)] + [(f"staleness {k}{' + correction' if c else ''}", k, c)
                                       for k in s.staleness for c in s.corrections]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    for seed in range(s.seeds):
        # the warm start of the embedded default (its own seed), built once per seed
        policy = str(digits.warm_start(out / "learning" / f"warm_start-seed{seed}", seed=seed))
        for name, k, correction in variants:
            print(f"bench learning: seed {seed}, {name} ...", file=sys.stderr, flush=True)
            run_dir = out / "learning" / f"{stamp}-seed{seed}-{name.replace(' + ', '-').replace(' ', '')}"
            cfg = run_config(s, bootstrap, run_dir, policy, seed, max(k, 1), correction)
            prompts = list(build_prompts(cfg.feed))
            if name == "sync":
                run = await run_sync(s, cfg, prompts)
            else:
                run = await run_streaming(s, cfg, write_config(cfg, run_dir / "pipeline.yaml"), prompts, run_dir)
            run["seed"] = seed
            results[name].append(run)
            pts = curve(run, s.batch)
            print(f"bench learning:   reward {pts[0][3]:.3f} -> {pts[-1][3]:.3f} in {pts[-1][1]:.1f}s",
                  file=sys.stderr, flush=True)
    return results


def main(args: argparse.Namespace) -> int:
    from streamrl.runtime import broker_for
    from streamrl.pipeline_config import PipelineConfig

    s = setup_from(args)
    out = Path(args.out)
    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = args.bootstrap_servers
    started = time.monotonic()
    with broker_for(cfg) as bootstrap:
        results = asyncio.run(_bench(s, bootstrap, out))
    plot_path = plot(results, s, out / "learning.png")
    table = {name: summarise(runs, s) for name, runs in results.items()}
    sync = table["sync"]
    print(f"setup: {s.versions} versions x {s.batch} trajectories, {s.seeds} seed(s); latencies: generation "
          f"{s.gen_latency_s:g} s/call, score {s.judge_latency_s:g} s, step {s.step_latency_s:g} s; target {s.target:g}")
    print(f"{'variant':28s} {'final (min..max)':>20s} {'s to target':>12s} {'samples':>8s} {'reached':>8s} "
          f"{'run s':>7s} {'dead':>6s}")
    for name, t in table.items():
        final = f"{t['final_reward']:.3f} ({t['final_min']:.2f}..{t['final_max']:.2f})"
        to_t = "-" if t["seconds_to_target"] is None else f"{t['seconds_to_target']:.1f}"
        n = "-" if t["samples_to_target"] is None else str(t["samples_to_target"])
        print(f"{name:28s} {final:>20s} {to_t:>12s} {n:>8s} {t['reached']:>8s} {t['seconds']:7.1f} "
              f"{t['dead_lettered']:6d}")
    ratios: dict[str, Any] = {}
    for name, t in table.items():
        if name == "sync":
            continue
        key = name.replace(" + ", "_").replace(" ", "_")
        for what, field in (("time", "seconds_to_target"), ("samples", "samples_to_target")):
            mine, theirs = t[field], sync[field]
            # None where either side never reached the target, or synchronous training started there
            ratios[f"{what}_to_target_vs_sync_{key}"] = round(mine / theirs, 3) if mine is not None and theirs else None
    result = {"target": s.target, **ratios, "variants": table, "setup": asdict(s),
              "seconds": round(time.monotonic() - started, 1), "plot": str(plot_path)}
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0
