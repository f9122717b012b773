"""``streamrl bench ablation``: verl's asynchronous reward agent ablation, at CPU scale, in one run.

verl's asynchronous reward agent (volcengine/verl PR #2854, ``recipe/async_reward_agent``) put a
1-40 s uniform artificial delay on every GSM8K reward call (a remote reward service) and reported,
for Qwen2-7B on Megatron, total training time against the synchronous baseline: mini-batch
pipeline alone -12.0 %, one-step off-policy alone -24.7 %, both -30.4 %. This bench runs the same
four schedules over the same rollouts and the same learner steps, one after another:

``sync``
    verl's colocated loop: generate the batch, score all of it, train on it (its mini-batch
    updates), repeat.
``pipeline_only``
    the agent's mini-batch pipeline (``mini_batch_pipeline=True``): after generating, the batch
    goes to the agent at once and the learner takes mini-batches of *complete groups in the order
    they finish scoring* (the agent's ``get(ppo_mini_batch_size * n)``), updating on each as soon
    as it is there. On-policy: the next batch is generated only after the last update.
``off_policy_only``
    the agent's one-step off-policy: batch 0 is generated before the loop; step k first generates
    batch k+1 (with the weights that have not seen batch k) and hands it to the agent, then waits
    for *all* of batch k's rewards and trains on it. Colocated, as the agent is ("we reverted to the
    colocated design"): generation and training take turns on one device, so what overlaps is the
    reward wait with the next generation, not generation with training.
``both``
    one-step off-policy with the mini-batch pipeline (the agent's headline configuration).

One difference from the agent, deliberate: streamrl's ``Scoring`` bounds its thread calls with one
first-come, first-served bound that every batch shares, so in the off-policy modes the next batch's
calls take the slots that the previous batch's slowest calls leave idle; the agent's proxy thread
takes the next batch only once every call of the previous one has returned (and its Ray actor runs
one method at a time), so each step pays the slowest calls' tail. ``--agent-barrier`` scores one
batch at a time, as the agent does.

The same batches are generated in every mode (the last step of the off-policy modes generates no
extra batch), every mode makes the same ``steps x mini_batches`` updates, and each trajectory's
reward delay is the same in every mode (a hash of its prompt and sample index picks its point in
[1, 40] s), so the modes differ only in scheduling. Figures: total seconds per mode for all the
steps (what the agent reports: training time for the same steps), and ``reduction = 1 -
seconds[mode] / seconds["sync"]``.

What is real and what is simulated:

- **Real**: the prompts (GSM8K train by ``--dataset``, ``streamrl.datasets.read_rows``) and their
  ground truths; the scoring path, streamrl's own ``streamrl.reward.scoring.Scoring`` (scorer table,
  retries, fp32 rewards, ``Rewarded`` records) with one ``type: function`` entry serving ``gsm8k``,
  ``executor: thread``, ``reward.thread_concurrency`` calls at once (the agent's
  ``max_concurrency`` thread pool); the function it runs (``remote_gsm8k_score``) is a sync
  function with verl's signature that blocks in ``time.sleep`` for the delay, as the agent's own
  ``recipe/async_reward_agent/reward/gsm8k.py`` does, then scores with streamrl's GSM8K scorer in
  verl's ``strict`` mode; GRPO group advantages per mini-batch (what verl's driver computes
  before each update).
- **Simulated**: the responses (deterministic per prompt and sample, right or wrong by a hash) and
  the *durations* of the device's work: generating a batch takes ``--gen-s``, one mini-batch update
  ``--step-s``. Why not the tiny real model: the question is scheduling, and the answer depends only
  on the ratio of generation and update time to the reward wait. On this 2-core machine the tiny
  policy's CPU costs are fixed by the hardware (~0.06 s a step) and would compete for the same two
  cores with the scoring threads, which on the agent's cluster (GPUs for the model, a remote
  service for rewards) they do not; fixed, explicit durations let the ratios be set to the agent's
  and keep every mode paying exactly the same device time. verl's ``old_log_prob`` / ``ref``
  passes are left out: they run while rewards are pending in every mode, so they hide behind the
  reward wait in all four alike as long as that wait is the longer (it is, at these ratios).

``--delay-scale`` multiplies every simulated duration (the reward delays, generation, updates), so
the cost ratios are the same at any scale: 1.0 is the agent's own seconds, the default 0.01 makes
the whole bench take about 4 minutes here. The default workload keeps the agent's proportions:
groups of 5 samples, 4 mini-batches per batch, and as many samples per batch as 20 times the
scorer's concurrency (theirs: 1024 prompts x 5 = 5120 samples over a 256-thread pool; here 64 x 5
= 320 over 16), so a batch's scoring takes ~20 waves of mean 20.5 s (~410 s at scale 1, plus the
tail of the slowest calls). Generation (120 s per batch at scale 1) and updates (35 s per
mini-batch) make the device's work ~37 % of the synchronous step; the agent's own figures imply
~29 % (BENCHMARKS.md derives it), where the gain of either off-policy mode is capped near 30 %
(``1 - rewards / sync``) and a 10-step run ends right at the agent's headline. The default leaves
room above it; ``--gen-s 80 --step-s 25`` is the agent's ratio. Last line of stdout: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamrl.bench import harness
from streamrl.bench._sim import unit
from streamrl.datasets import read_rows
from streamrl.feed.prompts import gsm8k_ground_truth
from streamrl.plotting import pyplot, save
from streamrl.records import Trajectory
from streamrl.reward.config import RewardConfig, ScorerSpec
from streamrl.scorers import gsm8k

HELP = "verl reward-agent ablation: sync vs mini-batch pipeline vs one-step off-policy vs both"

MODES = ("sync", "pipeline_only", "off_policy_only", "both")
#: mode -> (mini-batch pipeline, one-step off-policy)
SCHEDULES = {"sync": (False, False), "pipeline_only": (True, False),
             "off_policy_only": (False, True), "both": (True, True)}
#: Training-time reductions reported by verl's asynchronous reward agent (PR #2854, Megatron,
#: Qwen2-7B-Instruct, GSM8K, 1-40 s reward delay): 17h53m baseline; 15h41m, 13h23m, 12h22m.
AGENT_REDUCTION = {"pipeline_only": 0.120, "off_policy_only": 0.247, "both": 0.304}

DATA_SOURCE = "gsm8k"
SCORER = "gsm8k_remote"


# -- the reward function the scorer entry runs --------------------------------------------------

def remote_gsm8k_score(data_source: str, solution_str: str, ground_truth: str | None,
                       extra_info: dict[str, Any] | None = None, latency: float = 40.0,
                       min_latency: float = 1.0, scale: float = 1.0) -> dict[str, Any]:
    """A remote reward service as verl's reward agent simulates one: block for a delay uniform on
    ``[min_latency, latency]`` seconds times ``scale`` (``time.sleep``, as a blocking HTTP call
    would), then score GSM8K (streamrl's scorer, verl's ``strict`` mode). The delay's point in the
    range is a hash of ``extra_info``'s ``index`` and ``sample`` where it has them, so a trajectory
    costs the same in every mode; otherwise it is random, as in the agent's test."""
    info = extra_info or {}
    u = (unit(f"delay\x00{info['index']}\x00{info['sample']}".encode()) if "index" in info and "sample" in info
         else random.random())
    time.sleep((min_latency + (latency - min_latency) * u) * scale)
    return gsm8k.compute_score(data_source, solution_str, ground_truth, extra_info, method="strict")


# -- the workload --------------------------------------------------------------------------------

@dataclass
class Workload:
    steps: int
    prompts: int  # per batch (verl's train_batch_size)
    group_size: int  # samples per prompt (rollout.n)
    mini_batches: int  # updates per batch (train_batch_size / ppo_mini_batch_size)
    concurrency: int  # reward calls at once (the agent's max_concurrency)
    delay_low_s: float
    delay_high_s: float
    gen_s: float  # generating one batch, at scale 1
    step_s: float  # one mini-batch update, at scale 1
    delay_scale: float
    agent_barrier: bool = False  # score one batch at a time, as verl's agent does

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def groups_per_mini_batch(self) -> int:
        return self.prompts // self.mini_batches

    def expected(self) -> dict[str, float]:
        """Back-of-envelope seconds per step (scaled): generation, updates, and the reward phase
        of one batch on its own (waves of the pool at the mean delay)."""
        mean = (self.delay_low_s + self.delay_high_s) / 2
        s = self.delay_scale
        return {"generation": self.gen_s * s, "updates": self.mini_batches * self.step_s * s,
                "rewards": self.samples / self.concurrency * mean * s}


def workload_from(args: argparse.Namespace) -> Workload:
    steps = args.steps or (3 if args.quick else 10)
    prompts = args.prompts or (16 if args.quick else 64)
    scale = args.delay_scale if args.delay_scale is not None else (0.002 if args.quick else 0.01)
    concurrency = args.concurrency or max(1, prompts * args.group_size // 20)
    if args.mini_batches < 1 or prompts % args.mini_batches:
        raise SystemExit("streamrl bench ablation: --prompts must be a multiple of --mini-batches")
    if steps < 1 or scale <= 0 or not 0 <= args.delay_low <= args.delay_high:
        raise SystemExit("streamrl bench ablation: needs --steps >= 1, --delay-scale > 0 and "
                         "0 <= --delay-low <= --delay-high")
    return Workload(steps=steps, prompts=prompts, group_size=args.group_size,
                    mini_batches=args.mini_batches, concurrency=concurrency,
                    delay_low_s=args.delay_low, delay_high_s=args.delay_high, gen_s=args.gen_s,
                    step_s=args.step_s, delay_scale=scale, agent_barrier=args.agent_barrier)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, bootstrap=False, out="where ablation.json and ablation.png go",
                                 quick="a CI-sized run (3 steps of 16 prompts, --delay-scale 0.002: ~15 s)")
    parser.add_argument("--steps", type=int, default=0, help="training steps per mode (default 10, --quick 3)")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per batch (default 64, --quick 16)")
    parser.add_argument("--group-size", type=int, default=5, help="samples per prompt (the agent's rollout.n)")
    parser.add_argument("--mini-batches", type=int, default=4, help="updates per batch")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="reward calls at once (reward.thread_concurrency); default samples per batch / 20")
    parser.add_argument("--delay-low", type=float, default=1.0, help="reward delay range, seconds at scale 1")
    parser.add_argument("--delay-high", type=float, default=40.0)
    parser.add_argument("--delay-scale", type=float, default=None,
                        help="multiplies every simulated duration (default 0.01, --quick 0.002)")
    parser.add_argument("--gen-s", type=float, default=120.0, help="generating one batch, seconds at scale 1")
    parser.add_argument("--step-s", type=float, default=35.0, help="one mini-batch update, seconds at scale 1")
    parser.add_argument("--agent-barrier", action="store_true",
                        help="score one batch at a time, as verl's agent does (its proxy thread takes the "
                             "next batch only once every call of the last one has returned)")
    parser.add_argument("--dataset", default="gsm8k",
                        help="GSM8K-style dataset (question, answer): gsm8k (from the hub) or a file")


@dataclass
class Question:
    """One question of the workload (the bench makes its trajectories itself: not a feed
    ``records.Prompt``)."""

    index: int
    question: str
    ground_truth: str


def load_prompts(dataset: str, n: int) -> list[Question]:
    rows = read_rows(dataset, n, field="--dataset")
    if len(rows) < n:
        raise SystemExit(f"streamrl bench ablation: {dataset} has {len(rows)} rows, the run needs {n}")
    return [Question(i, str(r["question"]), gsm8k_ground_truth(str(r["answer"]))) for i, r in enumerate(rows)]


def rollout(prompt: Question, sample: int, group_size: int, version: int) -> Any:
    """One simulated response: the same text for (prompt, sample) in every mode, right about
    60 % of the time."""
    u = unit(f"answer\x00{prompt.index}\x00{sample}".encode())
    answer = prompt.ground_truth if u < 0.6 else prompt.ground_truth + str(1 + int(u * 9))
    text = f"Working through it step by step (sample {sample}), the total comes to {answer}.\n#### {answer}"
    return Trajectory(id=f"ablation-{prompt.index}-{sample}", group_id=f"ablation-{prompt.index}",
                      group_size=group_size, policy_version=version, data_source=DATA_SOURCE,
                      prompt=prompt.question, response=text, ground_truth=prompt.ground_truth,
                      extra_info={"index": prompt.index, "sample": sample})


def reward_config(w: Workload) -> Any:
    rc = RewardConfig()
    rc.thread_concurrency = w.concurrency
    rc.max_in_flight = 4 * w.samples
    rc.scorers = {SCORER: ScorerSpec(
        type="function", path=f"{__name__}:remote_gsm8k_score", executor="thread",
        data_sources=[DATA_SOURCE], timeout_s=max(120.0, 4 * w.delay_high_s * w.delay_scale),
        kwargs={"latency": w.delay_high_s, "min_latency": w.delay_low_s, "scale": w.delay_scale})}
    return rc


# -- the reward agent over streamrl's Scoring ----------------------------------------------------

class BatchRequest:
    """One batch handed to the agent (its ``compute_reward_pipeline``): every trajectory is scored
    through ``Scoring.reward`` at once (the thread bound queues them first come, first served);
    groups are ``get`` in the order they complete, or ``all`` in batch order."""

    def __init__(self, scoring: Any, groups: list[list[Any]], on_done: Any,
                 after: "BatchRequest | None" = None):
        self.n = len(groups)
        self.done: dict[int, list[Any]] = {}
        self.finished = asyncio.Queue()
        self.complete = asyncio.Event()
        self._on_done = on_done
        self._after = after
        self.submitted = time.monotonic()
        self.tasks = [asyncio.create_task(self._group(scoring, i, g)) for i, g in enumerate(groups)]

    async def _group(self, scoring: Any, i: int, group: list[Any]) -> None:
        after = self._after
        try:
            if after is not None:  # --agent-barrier: not before the previous batch is done
                await after.complete.wait()
                self._after = None  # no chain of every batch kept alive
            self.done[i] = list(await asyncio.gather(*(scoring.reward(t) for t in group)))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.finished.put_nowait(exc)
            self.complete.set()
            raise
        self.finished.put_nowait(i)
        if len(self.done) == self.n:
            self.complete.set()
            self._on_done(self.submitted, time.monotonic())

    async def get(self, n_groups: int) -> list[list[Any]]:
        """The next ``n_groups`` groups to finish (the agent's ``get``)."""
        out = []
        for _ in range(n_groups):
            item = await self.finished.get()
            if isinstance(item, BaseException):
                raise item
            out.append(self.done[item])
        return out

    async def all(self) -> list[list[Any]]:
        """Every group, in batch order, once the last is scored (the agent's ``compute_reward``)."""
        await asyncio.gather(*self.tasks)
        return [self.done[i] for i in range(self.n)]


@dataclass
class ModeResult:
    seconds: float = 0.0
    updates: int = 0
    scored: int = 0
    reward_sum: float = 0.0
    max_staleness: int = 0
    busy_s: dict[str, float] = field(default_factory=lambda: {"generate": 0.0, "update": 0.0, "wait": 0.0})
    events: list[tuple[str, float, float, int]] = field(default_factory=list)  # kind, start, end, batch


async def run_mode(mode: str, w: Workload, prompts: list[Question], progress: Any) -> ModeResult:
    """``w.steps`` steps under one schedule, as verl's ``fit`` drives them: one controller, the
    device's work in sequence, the reward agent in the background."""
    import torch

    from streamrl.learner.losses import grpo_advantages
    from streamrl.reward.scoring import Scoring

    pipeline, off_policy = SCHEDULES[mode]
    s = w.delay_scale
    scoring = Scoring(reward_config(w), group_hook=False)
    await scoring.start()
    res = ModeResult()
    t0 = time.monotonic()
    version = 0  # weights version: one per step (its mini-batch updates)
    last: BatchRequest | None = None  # the batch handed to the agent last

    def record(kind: str, start: float, end: float, batch: int) -> None:
        res.events.append((kind, start - t0, end - t0, batch))
        if kind in res.busy_s:
            res.busy_s[kind] += end - start

    async def hold(start: float, seconds: float) -> None:
        """The device busy until ``start + seconds`` (whatever the bookkeeping cost)."""
        await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))

    async def generate(k: int) -> BatchRequest:
        start = time.monotonic()
        batch = prompts[k * w.prompts:(k + 1) * w.prompts]
        groups = [[rollout(p, j, w.group_size, version) for j in range(w.group_size)] for p in batch]
        await hold(start, w.gen_s * s)
        record("generate", start, time.monotonic(), k)
        nonlocal last
        last = BatchRequest(scoring, groups, lambda a, b, k=k: record("reward", a, b, k),
                            after=last if w.agent_barrier else None)
        return last

    async def update(k: int, groups: list[list[Any]]) -> None:
        start = time.monotonic()
        rewarded = [r for g in groups for r in g]
        rewards = [float(r.reward) for r in rewarded]
        grpo_advantages(torch.tensor(rewards), [r.group_id for r in rewarded])  # the driver's part, as verl's
        res.max_staleness = max(res.max_staleness, max(version - r.policy_version for r in rewarded))
        res.scored += len(rewarded)
        res.reward_sum += sum(rewards)
        await hold(start, w.step_s * s)
        record("update", start, time.monotonic(), k)
        res.updates += 1
        progress.update(1)

    async def waited(k: int, awaitable: Any) -> Any:
        start = time.monotonic()
        out = await awaitable
        record("wait", start, time.monotonic(), k)
        return out

    async def train(k: int, request: BatchRequest) -> None:
        nonlocal version
        per = w.groups_per_mini_batch
        if pipeline:  # each mini-batch as soon as enough groups are scored
            for _ in range(w.mini_batches):
                await update(k, await waited(k, request.get(per)))
        else:  # the whole batch's rewards first
            groups = await waited(k, request.all())
            for m in range(w.mini_batches):
                await update(k, groups[m * per:(m + 1) * per])
        version += 1

    try:
        if off_policy:
            pending = await generate(0)
            for k in range(w.steps):
                ahead = await generate(k + 1) if k + 1 < w.steps else None
                await train(k, pending)
                pending = ahead
        else:
            for k in range(w.steps):
                await train(k, await generate(k))
        res.seconds = time.monotonic() - t0
    finally:
        await scoring.close()
    return res


# -- the bench -----------------------------------------------------------------------------------

def plot(results: dict[str, ModeResult], reduction: dict[str, float], w: Workload, path: Path) -> None:
    """Seconds per mode; reductions next to the agent's; the first steps' timelines."""
    plt = pyplot()

    fig = plt.figure(figsize=(11, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.15])
    ax1, ax2, ax3 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    colors = {"sync": "#888888", "pipeline_only": "#6aa5e0", "off_policy_only": "#3a7dc9", "both": "#1f4e8c"}
    names = list(results)
    bars = ax1.bar(names, [results[n].seconds for n in names], color=[colors[n] for n in names])
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylim(0, 1.15 * max(results[n].seconds for n in names))
    ax1.set(ylabel="seconds", title=f"Training time, {w.steps} steps x {w.samples} samples")
    ax1.tick_params(axis="x", labelsize=8)

    others = [n for n in names if n != "sync"]
    x = range(len(others))
    b1 = ax2.bar([i - 0.2 for i in x], [100 * reduction[n] for n in others], 0.4, color="#3a7dc9",
                 label="this bench")
    b2 = ax2.bar([i + 0.2 for i in x], [100 * AGENT_REDUCTION[n] for n in others], 0.4, color="#e08a3a",
                 label="verl reward agent (PR #2854)")
    ax2.bar_label(b1, fmt="%.1f%%", fontsize=8)
    ax2.bar_label(b2, fmt="%.1f%%", fontsize=8)
    ax2.set_xticks(list(x), others, fontsize=8)
    top = max([100 * reduction[n] for n in others] + [100 * AGENT_REDUCTION[n] for n in others])
    ax2.set_ylim(0, 1.4 * top)
    ax2.set(ylabel="reduction vs sync (%)", title="Training-time reduction")
    ax2.legend(fontsize=8, loc="upper left")

    shown = min(w.steps, 3)
    style = {"generate": ("#2ca02c", "generate"), "update": ("#d62728", "update"),
             "wait": ("#dddddd", "device waits for rewards")}
    seen = set()
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        # up to the end of step `shown`'s last update: what runs meanwhile included, cut there
        cutoff = max(e for kind, _, e, b in results[name].events if kind == "update" and b == shown - 1)
        for kind, start, end, batch in results[name].events:
            if start >= cutoff:
                continue
            end = min(end, cutoff)
            if kind == "reward":  # alternate heights: one batch's span may overlap the next's
                level = y - 0.27 - 0.12 * (batch % 2)
                ax3.plot([start, end], [level, level], color="#9467bd", lw=2.5, solid_capstyle="butt",
                         label=None if "reward" in seen else "a batch's rewards in flight")
                seen.add("reward")
                continue
            color, label = style[kind]
            ax3.barh(y + 0.08, end - start, left=start, height=0.45, color=color,
                     edgecolor="white", linewidth=0.3, label=None if kind in seen else label)
            seen.add(kind)
    ax3.set_yticks(range(len(names)), list(reversed(names)), fontsize=8)
    ax3.set(xlabel="seconds since the mode started",
            title=f"The first {shown} steps: one device, generation and updates in turn")
    ax3.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    ax3.grid(axis="x", alpha=0.3)
    save(fig, path, dpi=80)


class AblationBench(harness.Bench):
    """The four schedules (``MODES``), one run each, over the same batches: consecutive GSM8K
    train prompts."""

    name = "ablation"
    variants = MODES
    seconds_key = "bench_seconds"

    def __init__(self, args: argparse.Namespace):
        import streamrl.scorers.gsm8k  # noqa: F401 - imported before any clock starts

        super().__init__(args)
        self.w = workload_from(args)
        self.prompts = load_prompts(args.dataset, self.w.steps * self.w.prompts)
        self.units = self.w.steps * self.w.mini_batches  # the progress bar counts updates

    async def measure(self, mode: str, round: int) -> ModeResult:
        return await run_mode(mode, self.w, self.prompts, self.progress)

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        results = runs.single()
        reduction = {m: 1 - results[m].seconds / results["sync"].seconds for m in MODES if m != "sync"}
        steps = self.w.steps
        return {
            "seconds": {m: round(r.seconds, 3) for m, r in results.items()},
            "reduction": {m: round(v, 4) for m, v in reduction.items()},
            "agent_reduction": AGENT_REDUCTION,
            "s_per_step": {m: round(r.seconds / steps, 3) for m, r in results.items()},
            "device_wait_s": {m: round(r.busy_s["wait"], 3) for m, r in results.items()},
            "max_staleness": {m: r.max_staleness for m, r in results.items()},
            "updates": {m: r.updates for m, r in results.items()},
            "records_scored": {m: r.scored for m, r in results.items()},
            "reward_mean": {m: round(r.reward_sum / max(1, r.scored), 4) for m, r in results.items()},
            "workload": asdict(self.w),
        }

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        w = self.w
        one_at_a_time = "; one batch at a time" if w.agent_barrier else ""
        print(f"workload: {w.steps} steps x {w.prompts} GSM8K prompts x {w.group_size} samples "
              f"({w.mini_batches} mini-batch updates per step); reward delay uniform "
              f"{w.delay_low_s:g}-{w.delay_high_s:g} s x {w.delay_scale:g}, {w.concurrency} calls at once "
              f"(streamrl Scoring, function scorer, executor thread{one_at_a_time}); "
              f"generation {w.gen_s * w.delay_scale:.3g} s per batch, update {w.step_s * w.delay_scale:.3g} s "
              f"per mini-batch (simulated)")
        print("per step, on its own: " + ", ".join(f"{k} {v:.2f} s" for k, v in w.expected().items()))
        reduction = summary["reduction"]
        print(harness.table(
            ["mode", "seconds", "s/step", "reduction", "agent", "generate", "update", "waits", "staleness",
             "updates", "reward"],
            [[m, f"{r.seconds:.2f}", f"{r.seconds / w.steps:.2f}",
              f"{100 * reduction[m]:.1f}%" if m in reduction else "-",
              f"{-100 * AGENT_REDUCTION[m]:.1f}%" if m in AGENT_REDUCTION else "-",
              f"{r.busy_s['generate']:.2f}", f"{r.busy_s['update']:.2f}", f"{r.busy_s['wait']:.2f}",
              r.max_staleness, r.updates, f"{r.reward_sum / max(1, r.scored):.3f}"] for m, (r,) in runs.items()]))
        print("(reduction: 1 - seconds / sync seconds; agent: verl's reported change in training time; "
              "waits: the device idle until rewards come)")

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        results = runs.single()
        plot(results, {m: 1 - results[m].seconds / results["sync"].seconds for m in MODES if m != "sync"},
             self.w, path)


def main(args: argparse.Namespace) -> int:
    return harness.run(AblationBench(args))
