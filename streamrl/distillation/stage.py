"""The teacher stage: one member of the teacher consumer group. It reads the records the learner
would train on, before the learner (``rewarded`` with task rewards; ``rollouts`` without: no
reward group runs then), attaches the teacher's log-probs to each (``teacher.Teacher``) and
publishes it to ``distilled``, the learner's input when ``distillation.enabled``.

Why a topic of its own after the reward group rather than beside it: a record then carries the
reward and the teacher's log-probs at once, with no join in the learner (a join would hold the
first half of every record until the second came, and decide what a lost half means); each
group still scales on its own lag, and the extra hop costs latency, not throughput. Replaying
``rewarded`` through another teacher re-distils a run (``docs/guides/distillation.md``).

Several teachers (verl's ``distillation.teacher_models``, one per data source): each is its own
consumer group on the same input (``streamrl teacher --teacher NAME``), annotating the records
its key (``distillation.teacher_key``: the data source) names and passing over the others, so
each group scales on its own lag and a slow or dead teacher holds only its own data source. All
write to the one ``distilled`` topic, so the learner reads one input as with one teacher. A
record no teacher serves is the first teacher's to hand on unannotated (``teacher.unserved:
train``: trained without distillation) or to dead-letter (``deadletter``, reason ``no_teacher``).
Why one input read by every group rather than a topic per teacher: passing over a record costs
its decode, and a topic per teacher would need a router stage (another hop, another group) or
the reward stage to know the teachers.

As the reward stage, it composes the bus's ``StageLoop`` (consuming, back-pressure, commits after
the output is acknowledged, dead letters) with the teacher; a crash redelivers what was not
committed, and the learner de-duplicates by ``id``, so a record is trained once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar, Protocol

import numpy as np

import streamrl
from streamrl import metrics
from streamrl.bus import Bus, Message, StageLoop
from streamrl.config import BusConfig
from streamrl.distillation.config import DistillationConfig, Teacher, TeacherConfig
from streamrl.distillation.teacher import Annotation, build_teacher, check_tokenizer, token_ids
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
    learner: Any  # its policy: the student, whose tokenizer the teacher must share


class TeacherStage:
    """Build with a config (the teacher model is loaded here: a bad config or a missing model
    fails before anything connects), then ``await run(stop_event)``."""

    name: ClassVar[str] = STAGE

    def __init__(self, cfg: TeacherSections, bus: Bus | None = None):
        self.cfg = cfg
        self.validate()
        self.me = self._which(cfg.distillation.teachers(cfg.teacher), cfg.teacher.name)
        self.tc = self.me.config
        loss = cfg.distillation.distillation_loss
        self.topk = int(loss.topk) if loss.use_topk else 0
        self.source = REWARDED if loss.use_task_rewards else ROLLOUTS
        self.group = self.me.group(cfg.bus.group(STAGE))
        self.teacher = build_teacher(self.tc, self.topk)
        if hasattr(self.teacher, "load"):
            self.teacher.load()
        check_tokenizer(self.teacher, self.tc, self.me.label, getattr(getattr(cfg, "learner", None), "policy", ""))
        self.info = {"model": self.tc.model, "backend": self.tc.backend, "version": streamrl.__version__,
                     **({"name": self.me.name, "key": self.me.key} if self.me.name else {})}
        self.bus = bus or Bus(cfg.bus)
        self.loop: StageLoop | None = None

    def _which(self, teachers: dict[str, Teacher], name: str) -> Teacher:
        """This member's teacher (``--teacher NAME``); the keys of the others, and whether it
        handles the records no teacher serves (the first teacher does)."""
        self.routed = self.cfg.distillation.routed
        self.keys = {t.key for t in teachers.values()}
        first = next(iter(teachers))
        if not self.routed:  # one teacher: it serves every record (verl's single-teacher path)
            if name and name not in teachers:
                raise ConfigError(f"config field 'teacher.name' (--teacher): {name!r} is not a teacher of this run "
                                  f"(one: {first or 'teacher:'})")
            self.handles_unserved = False
            return teachers[first]
        if name not in teachers:
            raise ConfigError(f"config field 'teacher.name' (--teacher): with several teachers each member runs one of "
                              f"{', '.join(teachers)} (got {name!r})")
        self.handles_unserved = name == first
        return teachers[name]

    @classmethod
    def from_config(cls, cfg: TeacherSections, bus: Bus) -> "TeacherStage":
        return cls(cfg, bus)

    def validate(self) -> None:
        self.cfg.distillation.validate()
        self.cfg.teacher.validate()
        if not self.cfg.distillation.enabled:
            raise ConfigError("config field 'distillation.enabled': the teacher stage runs for distillation "
                              "(set distillation.enabled=true)")

    def describe(self) -> str:
        what = f"top-{self.topk} log-probs" if self.topk else "the sampled tokens' log-probs"
        serves = (f" for {self.cfg.distillation.teacher_key} {self.me.key}"
                  + (f" (and the records no teacher serves: {self.tc.unserved})" if self.handles_unserved else "")
                  if self.routed else "")
        return (f"group {self.group}, {self.tc.backend} teacher {self.me.label} ({self.tc.model}): {what}{serves}, "
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
        label = self.me.label
        if self.routed:
            key = str(getattr(record, self.cfg.distillation.teacher_key, ""))
            if key != self.me.key:
                return self._not_mine(record, key)
        try:
            prompt, response = token_ids(record)
            annotation = await self._annotate(prompt, response)
        except Failure as exc:
            metrics.TEACHER_FAILED.labels(exc.reason, label).inc()
            raise
        out = Distilled.annotate(record, logprobs=annotation.logprobs.reshape(-1),
                                 ids=None if annotation.ids is None else annotation.ids.reshape(-1),
                                 topk=self.topk, teacher=self.info)
        metrics.TEACHER_ANNOTATED.labels(self.tc.backend, label).inc()
        metrics.TEACHER_TOKENS.labels(self.tc.backend, label).inc(len(response))
        return [out]

    def _not_mine(self, record: Trajectory, key: str) -> list[Distilled]:
        """Another teacher's record: passed over (its group annotates it). One no teacher serves:
        the first teacher hands it on unannotated (``train``) or dead-letters it; the others pass
        it over."""
        if key in self.keys or not self.handles_unserved:
            metrics.TEACHER_PASSED.labels(self.me.label).inc()
            return []
        metrics.TEACHER_UNSERVED.labels(self.tc.unserved).inc()
        if self.tc.unserved == "deadletter":
            raise Failure("no_teacher", f"no teacher serves {self.cfg.distillation.teacher_key} {key!r} "
                                        f"(teachers: {', '.join(sorted(self.keys))}; teacher.unserved: deadletter)")
        return [Distilled.annotate(record, logprobs=np.zeros(0, np.float32), ids=None, topk=self.topk,
                                   teacher={"unserved": True, "version": streamrl.__version__})]

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
