"""The teacher stage: one member of the teacher consumer group. It reads the records the learner
would train on, before the learner (``rewarded`` with task rewards; ``rollouts`` without: no
reward group runs then), attaches the teacher's log-probs to each (``teacher.Teacher``) and
publishes it to ``distilled``, the learner's input when ``distillation.enabled``.

Why a topic of its own after the reward group rather than beside it: a record then carries the
reward and the teacher's log-probs at once, with no join in the learner (a join would hold the
first half of every record until the second came, and decide what a lost half means); each
group still scales on its own lag, and the extra hop costs latency, not throughput. Replaying
``rewarded`` through another teacher re-distils a run (``docs/guides/distillation.md``).

As the reward stage, it composes the bus's ``StageLoop`` (consuming, back-pressure, commits after
the output is acknowledged, dead letters) with the teacher; a crash redelivers what was not
committed, and the learner de-duplicates by ``id``, so a record is trained once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar, Protocol

import numpy as np

import streamrl
from streamrl import metrics
from streamrl.bus import Bus, Message, StageLoop
from streamrl.config import BusConfig
from streamrl.distillation.config import DistillationConfig, TeacherConfig
from streamrl.distillation.teacher import Annotation, build_teacher, token_ids
from streamrl.errors import ConfigError, Failure, Unavailable
from streamrl.records import REWARDED, ROLLOUTS, Distilled, Trajectory
from streamrl.reward.stage import same_partition

STAGE = "teacher"
log = logging.getLogger(__name__)


class TeacherSections(Protocol):
    """What the teacher stage reads of the pipeline's config."""

    bus: BusConfig
    distillation: DistillationConfig
    teacher: TeacherConfig


class TeacherStage:
    """Build with a config (the teacher model is loaded here: a bad config or a missing model
    fails before anything connects), then ``await run(stop_event)``."""

    name: ClassVar[str] = STAGE

    def __init__(self, cfg: TeacherSections, bus: Bus | None = None):
        self.cfg, self.tc = cfg, cfg.teacher
        self.validate()
        loss = cfg.distillation.distillation_loss
        self.topk = int(loss.topk) if loss.use_topk else 0
        self.source = REWARDED if loss.use_task_rewards else ROLLOUTS
        self.group = cfg.bus.group(STAGE, cfg.teacher.group)
        self.teacher = build_teacher(self.tc, self.topk)
        if hasattr(self.teacher, "load"):
            self.teacher.load()
        self.info = {"model": self.tc.model, "backend": self.tc.backend, "version": streamrl.__version__}
        self.bus = bus or Bus(cfg.bus)
        self.loop: StageLoop | None = None

    @classmethod
    def from_config(cls, cfg: TeacherSections, bus: Bus) -> "TeacherStage":
        return cls(cfg, bus)

    def validate(self) -> None:
        self.cfg.distillation.validate()
        self.tc.validate()
        if not self.cfg.distillation.enabled:
            raise ConfigError("config field 'distillation.enabled': the teacher stage runs for distillation "
                              "(set distillation.enabled=true)")

    def describe(self) -> str:
        what = f"top-{self.topk} log-probs" if self.topk else "the sampled tokens' log-probs"
        return (f"group {self.group}, {self.tc.backend} teacher {self.tc.model}: {what}, "
                f"{self.bus.topic(self.source)} -> {self.bus.topic('distilled')}")

    async def run(self, stop: asyncio.Event | None = None) -> None:
        await self.teacher.start()
        try:
            self.loop = StageLoop(self.bus, stage=STAGE, source=self.source, group=self.group, handle=self.handle,
                                  max_in_flight=self.tc.max_in_flight, drain_timeout_s=self.tc.drain_timeout_s,
                                  spread=same_partition)
            await self.loop.run_until(stop)
        finally:
            await self.teacher.close()

    async def handle(self, record: Trajectory, msg: Message) -> list[Distilled]:
        try:
            prompt, response = token_ids(record)
            annotation = await self._annotate(prompt, response)
        except Failure as exc:
            metrics.TEACHER_FAILED.labels(exc.reason).inc()
            raise
        out = Distilled.annotate(record, logprobs=annotation.logprobs.reshape(-1),
                                 ids=None if annotation.ids is None else annotation.ids.reshape(-1),
                                 topk=self.topk, teacher=self.info)
        metrics.TEACHER_ANNOTATED.labels(self.tc.backend).inc()
        metrics.TEACHER_TOKENS.labels(self.tc.backend).inc(len(response))
        return [out]

    async def _annotate(self, prompt: np.ndarray, response: np.ndarray) -> Annotation:
        """The teacher's annotation, retried with backoff; a ``Failure`` (the record's own fault)
        is not retried; ``teacher_error`` once the attempts are spent."""
        last: Exception | None = None
        attempt, held = 0, 0
        while attempt < self.tc.max_attempts:
            try:
                annotation = await self.teacher.annotate(prompt, response)
            except Failure:
                raise
            except Unavailable as exc:  # every server down: hold the record (back-pressure), never drop it
                held += 1
                log.warning("teacher: unavailable (%s), holding the record", exc)
                await asyncio.sleep(min(0.5 * held, 5.0))
                continue
            except Exception as exc:  # noqa: BLE001 - a backend error: retried, then dead-lettered with it
                last = exc
                log.warning("teacher: attempt %d failed: %s: %s", attempt + 1, type(exc).__name__, exc)
                attempt += 1
                await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
                continue
            if not np.isfinite(annotation.logprobs).all():
                raise Failure("teacher_error", "the teacher's log-probs are not finite")
            return annotation
        raise Failure("teacher_error", f"{self.tc.max_attempts} attempts failed; the last: {type(last).__name__}: {last}")
