"""The eval stage: a consumer group on ``policy`` that evaluates the asked versions.

For each asked version (``EvalConfig.asks``: 0 before training, every ``every``-th, the run's
last) it loads the version's weights into its own backend (the rollout's: the local engine, or
servers of its own), generates the validation set at ``val_kwargs`` prompt by prompt (same
seed, same order: the figure of a version does not depend on when it was evaluated, and
``streamrl replay --policy`` gives the same one), scores it with the reward table in process
(the reward stage's scorers and ``data_source`` routing) and publishes one ``EvalResult`` per
data source on ``eval``. Then it commits the policy record: a stage killed mid-evaluation
evaluates that version again, and the versions already on ``eval`` (read at start) are never
published twice.

Why a stage of its own: an evaluation takes as long as it takes and never holds back training;
a version it could not start before a newer asked one arrived is evaluated late, or skipped
with ``eval.skip_stale``. It ends after the run's last version (``PolicyVersion.final``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from streamrl import metrics
from streamrl.bus import Bus, Message, Reader, TopicPartition
from streamrl.chat import ChatRenderer
from streamrl.errors import Failure
from streamrl.evaluation.config import EvalConfig
from streamrl.evaluation.scores import core_variable, response_figures
from streamrl.feed.prompts import build_prompts
from streamrl.records import EvalResult, PolicyVersion, Prompt, RecordError, Trajectory
from streamrl.reward.scoring import Scoring
from streamrl.rollout.backends import BackendError, SamplingParams, make_backend
from streamrl.rollout.episode import run_group
from streamrl.rollout.multiturn import MultiTurn
from streamrl.rollout.worker import weights_allowed

if TYPE_CHECKING:
    from streamrl.feed.config import FeedConfig
    from streamrl.learner.config import LearnerConfig
    from streamrl.reward.config import RewardConfig
    from streamrl.rollout.backends import Backend
    from streamrl.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

STAGE = "eval"
#: prompts generated at once when the backend is a server fleet (an in-process engine: one)
SERVER_CONCURRENCY = 64


class EvalSections(Protocol):
    """What the eval stage reads of the pipeline's config: its own section, the feed's (how a
    row becomes a prompt), the rollout's (backend, policy, tools), the reward table, and where
    the learner writes weights (the only paths it loads from)."""

    eval: EvalConfig
    feed: "FeedConfig"
    rollout: "RolloutConfig"
    reward: "RewardConfig"
    learner: "LearnerConfig"


@dataclass
class Responses:
    """A validation set's responses for one version: each one's trajectory and score (or why it
    has none)."""

    trajectories: list[Trajectory] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    # prompts whose generation failed, by data source (their n responses are missing)
    failed_prompts: dict[str, int] = field(default_factory=dict)

    def results(self, version: int, n: int, seed: int, lineage: str | None) -> list[EvalResult]:
        """One record per data source: verl's figures over the scored responses."""
        figures = response_figures([(t.data_source, t.group_id, r, info) for t, r, info
                                    in zip(self.trajectories, self.rewards, self.infos) if r is not None], seed)
        sources = sorted({t.data_source for t in self.trajectories} | set(self.failed_prompts))
        out = []
        for ds in sources:
            mine = [i for i, t in enumerate(self.trajectories) if t.data_source == ds]
            flat = figures.get(ds, {})
            failed = sum(1 for i in mine if self.rewards[i] is None)
            out.append(EvalResult(version=version, data_source=ds, n=n,
                                  prompts=len({self.trajectories[i].group_id for i in mine}), metrics=flat,
                                  failed=failed + self.failed_prompts.get(ds, 0) * n,
                                  core=core_variable(flat), seed=seed, lineage=lineage))
        return out


class ValidationSet:
    """The validation prompts and how to generate and score them: the part the eval stage and
    ``streamrl replay --policy`` share, so both give the same figure for the same weights."""

    def __init__(self, prompts: list[Prompt], rollout: "RolloutConfig", reward: "RewardConfig", cfg: EvalConfig):
        self.prompts, self.cfg = prompts, cfg
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
                                     temperature=cfg.temperature if cfg.do_sample else 0.0,
                                     top_p=cfg.top_p if cfg.do_sample else 1.0)
        self.interaction = MultiTurn.from_config(rollout)  # the rollout workers' interactions and tools
        self.scoring = Scoring(reward, group_hook=False)

    @staticmethod
    def prompts_of(feed: "FeedConfig", cfg: EvalConfig) -> list[Prompt]:
        """The validation set's rows as prompts, converted as the feed converts its own (a bad
        row fails here, at start, naming file and row)."""
        spec = dataclasses.replace(feed, dataset=cfg.dataset, more_datasets=list(cfg.more_datasets),
                                   data_source=cfg.data_source or feed.data_source,
                                   group_size=cfg.n, limit=cfg.limit, epochs=1, start_epoch=0, shuffle=False,
                                   resume=False)
        return list(build_prompts(spec))

    async def start(self) -> None:
        await self.scoring.start()

    async def close(self) -> None:
        await self.scoring.close()

    async def run(self, backend: "Backend", progress: Any = None) -> Responses:
        """Generate every prompt's ``n`` responses with ``backend`` after seeding it with
        ``eval.seed``, and score them. An in-process engine goes prompt by prompt (its batches,
        and so its samples, are the same on every run); servers take ``SERVER_CONCURRENCY``
        prompts at once (their sampling is theirs to seed)."""
        backend.reseed(self.cfg.seed)
        renderer = ChatRenderer(backend.tokenizer)
        gate = asyncio.Semaphore(1 if backend.tokenizer is not None else SERVER_CONCURRENCY)

        async def one(prompt: Prompt) -> list[tuple[Trajectory, float | None, dict[str, Any]]] | None:
            async with gate:
                try:
                    group = await run_group(prompt, self.cfg.n, backend, self.params, renderer, self.interaction)
                except (BackendError, Failure) as exc:
                    log.warning("eval: prompt %s not generated: %s", prompt.group_id, exc)
                    return None
                scored = [(t, *await self._score(t)) for t in group]
            if progress is not None:
                progress.update(1)
            return scored

        out = Responses()
        for prompt, result in zip(self.prompts, await asyncio.gather(*(one(p) for p in self.prompts))):
            if result is None:  # (gathered in the prompts' order)
                out.failed_prompts[prompt.data_source] = out.failed_prompts.get(prompt.data_source, 0) + 1
                continue
            for t, reward, info in result:
                out.trajectories.append(t)
                out.rewards.append(reward)
                out.infos.append(info)
        return out

    async def _score(self, record: Trajectory) -> tuple[float | None, dict[str, Any]]:
        entry = self.scoring.table.lookup(record.data_source)
        if entry is None:
            return None, {"error": "unknown_data_source"}
        try:
            reward, info = await self.scoring.score(entry, record)
        except Failure as exc:
            return None, {"error": exc.reason, "detail": exc.detail}
        return float(reward), dict(info)


class Evaluator:
    """The stage (``streamrl eval``)."""

    name: ClassVar[str] = STAGE

    def __init__(self, bus: Bus, cfg: EvalConfig, validation: ValidationSet, backend: "Backend",
                 weights_prefixes: list[str]):
        self.bus, self.cfg = bus, cfg.validate()
        self.validation, self.backend, self.weights_prefixes = validation, backend, weights_prefixes
        self.group = bus.config.group(STAGE, cfg.group)
        self.consumer = bus.consumer(["policy"], self.group, STAGE)
        self.producer = bus.producer(STAGE)
        self.done: set[tuple[int, str]] = set()  # (version, data source) already on eval
        self.evaluated: list[int] = []  # versions this process evaluated, in order
        self.ended = False

    @classmethod
    def from_config(cls, cfg: EvalSections, bus: Bus) -> "Evaluator":
        ec = cfg.eval.validate()
        if not ec.enabled:
            from streamrl.errors import ConfigError

            raise ConfigError("config field 'eval.dataset': required for the eval stage (a file, gsm8k:test, "
                              "digits@1, ...)")
        rollout = cfg.rollout
        if rollout.backend == "openai":
            if not ec.servers:
                from streamrl.errors import ConfigError

                raise ConfigError("config field 'eval.servers': the eval stage with rollout.backend openai needs "
                                  "servers of its own (it loads each asked version into them; the training "
                                  "fleet's would be rolled back)")
            rollout = dataclasses.replace(rollout, servers=list(ec.servers))
        validation = ValidationSet(ValidationSet.prompts_of(cfg.feed, ec), rollout, cfg.reward, ec)
        prefixes = rollout.weights_prefixes or [cfg.learner.weights_dir,
                                                *([cfg.learner.weights_uri] if cfg.learner.weights_uri else [])]
        return cls(bus, ec, validation, make_backend(rollout), prefixes)

    def validate(self) -> None:
        self.cfg.validate()

    def describe(self) -> str:
        c = self.cfg
        return (f"{len(self.validation.prompts)} prompts of {c.dataset} x {c.n}, every {c.every} versions"
                f"{' and version 0' if c.before_train else ''}, group {self.group}, backend {self.backend.name}")

    async def run(self, stop: asyncio.Event | None = None) -> list[int]:
        """Evaluate asked versions until the run's last one is done or ``stop`` is set."""
        stop = stop or asyncio.Event()
        await self.producer.start()
        await self.validation.start()
        self.done = await published(self.bus)
        await self.consumer.start()
        pending: list[tuple[Message, PolicyVersion]] = []
        try:
            while not stop.is_set() and not self.ended:
                for msg in await self.consumer.getmany(timeout_ms=200):
                    record = self._decode(msg)
                    if record is not None:
                        pending.append((msg, record))
                    else:  # unreadable: the learner owns the topic; nothing to evaluate
                        await self._commit(msg)
                if not pending:
                    metrics.waiting(STAGE, "policy_versions")
                    continue
                metrics.waiting(STAGE, None)
                msg, record = pending.pop(0)
                if self.cfg.asks(record.version, record.final) and not self._is_done(record.version):
                    newer = [r for _, r in pending if self.cfg.asks(r.version, r.final)]
                    if self.cfg.skip_stale and newer and not record.final:
                        metrics.EVAL_VERSIONS.labels("skipped_stale").inc()
                        log.warning("eval: version %d skipped (eval.skip_stale): version %d is waiting",
                                    record.version, newer[-1].version)
                    else:
                        await self._evaluate(record)
                await self._commit(msg)
                self.ended = record.final
        finally:
            await self.consumer.stop()
            await self.validation.close()
            await self.producer.stop()
            await self.backend.close()
        if self.ended:
            log.warning("eval: ended after the run's last version; evaluated %s", self.evaluated)
        return self.evaluated

    def _decode(self, msg: Message) -> PolicyVersion | None:
        try:
            return PolicyVersion.decode(msg.value)
        except RecordError as exc:
            log.error("policy topic offset %d: unreadable record (%s); ignored", msg.offset, exc)
            return None

    def _is_done(self, version: int) -> bool:
        return any(v == version for v, _ in self.done)

    async def _commit(self, msg: Message) -> None:
        await self.consumer.commit({TopicPartition(msg.topic, msg.partition): msg.offset + 1})

    async def _evaluate(self, record: PolicyVersion) -> None:
        started = time.monotonic()
        uri = record.weights_uri
        if not uri or not all(weights_allowed(u, self.weights_prefixes) for u in (uri, record.base_uri) if u):
            metrics.EVAL_VERSIONS.labels("refused").inc()
            log.error("eval: version %d not evaluated: weights_uri %r is not under %s", record.version, uri,
                      self.weights_prefixes)
            return
        try:
            await self.backend.load_weights(uri, record.version, record.base_uri)  # base_uri: a LoRA adapter
        except Exception as exc:  # pruned, or unreadable: say so, evaluate the next one
            metrics.EVAL_VERSIONS.labels("no_weights").inc()
            log.error("eval: version %d not evaluated: its weights at %s did not load (%s); keep them with "
                      "learner.keep_every", record.version, uri, exc)
            return
        responses = await self.validation.run(self.backend)
        results = responses.results(record.version, self.cfg.n, self.cfg.seed, record.lineage)
        for result in results:
            await self.producer.send_and_wait(result)
            self.done.add((result.version, result.data_source))
            core = result.metrics.get(f"{result.core}/mean@{result.n}")
            if core is not None:
                metrics.EVAL_SCORE.labels(result.data_source).set(core)
        self.evaluated.append(record.version)
        metrics.EVAL_VERSIONS.labels("evaluated").inc()
        metrics.EVAL_VERSION.set(record.version)
        metrics.EVAL_SECONDS.observe(time.monotonic() - started)
        log.warning("eval: version %d: %s (%.1f s)", record.version,
                    ", ".join(f"{r.data_source} {r.core}/mean@{r.n} {r.metrics.get(f'{r.core}/mean@{r.n}', float('nan')):.4f}"
                              for r in results), time.monotonic() - started)


async def published(bus: Bus) -> set[tuple[int, str]]:
    """The (version, data source) pairs already on the eval topic, read to its end."""
    out: set[tuple[int, str]] = set()
    async with Reader(bus, ["eval"], STAGE) as reader:
        async for batch in reader.read():
            for msg in batch:
                try:
                    rec = EvalResult.decode(msg.value)
                except RecordError:
                    continue
                out.add((rec.version, rec.data_source))
    return out
