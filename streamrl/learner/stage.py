"""The learner stage: consume ``rewarded``, assemble fresh groups, train a mini-batch as soon as
one is there, and after every ``mini_batches_per_version`` mini-batches write the weights,
checkpoint, and announce the version on ``policy``.

Why not ``StageLoop``: its offsets are committed as soon as a record's outputs are acknowledged,
but a learner's record is finished only when its update is in a *checkpoint*; the offsets must
describe the same moment as the weights. So this loop owns a plain ``Consumer``, tracks offsets
with the bus's ``Checkpoint`` (a record is done when trained into the weights, or dropped
and its dead letter acknowledged, or a duplicate), and commits through it with the learner's checkpoint
as its "save state" step: outputs flushed, offsets
saved inside the checkpoint, then committed to Kafka. On (re)assignment it seeks to the
checkpoint's offsets.

Training runs in a worker thread (``asyncio.to_thread``) so the Kafka client's heartbeat keeps the
group membership alive during a long step.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol


from streamrl import metrics, resume
from streamrl.bus import Bus, Checkpoint, Message, Reader, TopicPartition
from streamrl.learner import checkpoint
from streamrl.learner.checkpoint import full_storage_stops
from streamrl.learner.assembler import FILTERED, Assembler, Drop, Group, Item
from streamrl.learner.config import LearnerConfig
from streamrl.learner.metrics import mean_metrics, observe_staleness, observe_update, record_figures
from streamrl.learner.samples import to_sample
from streamrl.learner.versions import (delta_writer, prune_weights, publish_base, publish_delta, read_latest_policy,
                                       start_line)
from streamrl.records import DISTILLED, REWARDED, DeadLetter, PolicyVersion, RecordError, Rewarded, Trajectory

if TYPE_CHECKING:
    from streamrl.feed.config import FeedConfig

log = logging.getLogger(__name__)

STAGE = "learner"


class LearnerSections(Protocol):
    """What the learner reads of the pipeline's config (a ``PipelineConfig`` is one): its own
    section, and the feed's to know the feed's groups and their size (the end of the data; a
    pipeline's config sets ``feed.group_size`` to ``rollout.group_size`` where that is set)."""

    learner: LearnerConfig
    feed: "FeedConfig"


def remax_baselines(groups: list[list["_Taken"]], remax: bool) -> list["_Taken"]:
    """The members to train on: each group without its ReMax baseline (the greedy response,
    ``record.baseline``), whose reward each of the others carries as ``reward_baseline``. A
    group that has none (a producer that sends no baseline, a partial group) uses its members'
    mean reward, and says so once (``remax``: the estimator is ReMax's)."""
    out = []
    for members in groups:
        base = [t for t in members if t.record.baseline]
        rest = [t for t in members if not t.record.baseline]
        if not rest:
            continue
        if base:
            value = float(base[0].record.reward)
        else:
            value = float(sum(t.record.reward for t in rest) / len(rest))
            if remax and _warn_once("remax"):
                log.warning("learner: group %s has no ReMax baseline (record.baseline): its mean reward stands in "
                            "(said once)", rest[0].record.group_id)
        for t in rest:
            t.sample.reward_baseline = value
        out += rest
    return out


_WARNED: set[str] = set()


def _warn_once(what: str) -> bool:
    if what in _WARNED:
        return False
    _WARNED.add(what)
    return True


@dataclass
class _Taken:
    """What the assembler carries for one record."""

    sample: Any  # samples.Sample
    message: Message
    record: Rewarded


class Learner:
    def __init__(self, bus: Bus, cfg: LearnerConfig, data_versions: int = 0):
        """``data_versions``: the versions the feed's data makes, the lr schedule's total where
        ``learner.versions`` is 0 (``from_config`` counts them)."""
        from streamrl.learner.trainer import Trainer

        self.bus, self.cfg = bus, cfg.validate()
        good = resume.latest_good(cfg.checkpoint_dir)
        last = good[0] if good else None
        # weights, optimizer (DCP shards) from the checkpoint; in a group rank 0 names it to all
        self.trainer = Trainer(cfg, resume=str(last) if last else None, data_versions=data_versions)
        for note in cfg.start_notes():  # once, at start
            log.warning("learner: %s", note)
        if good is not None:
            self.state = good[1]
            log.warning("learner: resumed from %s at version %d", last, self.state.version)
        else:
            self.state = resume.LearnerState()
        self.state.lineage = self.state.lineage or uuid.uuid4().hex[:12]
        self.resumed_from = last
        self.assembler = Assembler(max_staleness=cfg.max_staleness, group_timeout_s=cfg.group_timeout_s,
                                   allow_partial_groups=cfg.allow_partial_groups,
                                   dedup_window=cfg.dedup_window, filter_flat=cfg.filter_groups.enable,
                                   filter_bound=cfg.filter_groups.max_num_gen_batches
                                   * cfg.groups_per_mini_batch * cfg.mini_batches_per_version,
                                   keep_versions=cfg.dedup_versions, keep_seconds=cfg.dedup_seconds)
        self.assembler.load_state_dict(self.state.assembler, self.state.version)
        self.producer = bus.producer(STAGE)
        self.group = bus.config.group(STAGE, cfg.consumer_group)
        # distillation: the teacher's topic (its records are rewarded ones with the teacher's log-probs)
        self.source = DISTILLED if cfg.distillation.enabled else REWARDED
        self.consumer = bus.consumer([self.source.name], self.group, STAGE,
                                     on_assigned=self._assigned, on_revoked=self._revoked)
        self.checkpointer = Checkpoint(self.consumer, self.producer)
        self._version_metrics: list[dict[str, float]] = []
        self._version_started = time.monotonic()  # for timing_s/step: the wall time of a version
        self._version_dead = 0  # dead letters of this learner since the last version (filtered ones apart)
        self._final = False  # the data ended: the next version announced is the run's last
        self._last: PolicyVersion | None = None  # the last version this learner announced
        self._dirty = False
        self._leaving = False  # set when the learner leaves its group (its revocation is expected)
        self.last_checkpoint: Path | None = last
        # the end of the data (learner.end_with_data): the feed's group ids, set by from_config
        self.expected: set[str] | None = None
        # the feed's finished groups (with its order, once ``expect``-ed: those of the checkpoint's bits too)
        self.done_groups: set[str] = set(self.state.done_groups)
        self._order: list[str] | None = None  # the feed's group ids in its order (``expect``)
        self._remaining: set[str] = set()
        self._lost: dict[str, set[str]] = {}  # group id -> member ids dead-lettered before training
        self._sizes: dict[str, int] = {}  # group id -> group_size, for groups known only by losses
        self._group_size = 1
        self._dead: Reader | None = None
        self._base_uri: str | None = None  # LoRA: where the base the adapters apply to is (written once)
        # learner.weights_delta: versions published as the change from the previous one (its
        # first version in this process is full: no reader could know a base of ours before it)
        self._delta = delta_writer(cfg)
        metrics.LEARNER_VERSION.set(self.state.version)
        metrics.LEARNER_MAX_STALENESS.set(cfg.max_staleness)

    name: ClassVar[str] = STAGE

    @classmethod
    def from_config(cls, cfg: "LearnerSections", bus: Bus) -> "Learner":
        """The learner of a pipeline's config. Where the run ends with the data, the feed's data
        is read here, at start (not when the config is checked: a dry-run's dataset need not
        exist), for its group ids and, where ``learner.versions`` is 0, the versions it makes:
        the lr schedule's total, as verl counts its steps from its dataloader."""
        ids: list[str] | None = None
        if cfg.learner.end_with_data:
            from streamrl.feed.prompts import feed_group_ids

            try:
                ids = feed_group_ids(cfg.feed)
            except Exception as exc:  # a dataset this process cannot read: the run ends by versions
                log.warning("learner: the feed's data (%s) not read (%s): the run ends at learner.versions "
                            "or when stopped", cfg.feed.dataset, exc)
        total = 0
        if ids is not None:
            from streamrl.learner.schedule import data_versions

            per_version = cfg.learner.groups_per_mini_batch * cfg.learner.mini_batches_per_version
            total = data_versions(len(ids) // cfg.feed.epochs, cfg.feed.epochs, per_version)
        learner = cls(bus, cfg.learner, data_versions=total)
        if ids is not None:
            learner.expect(ids, cfg.feed.group_size)
        return learner

    def expect(self, group_ids: list[str], group_size: int) -> None:
        """End when every group in ``group_ids`` (the feed's, in its order) is finished (trained,
        or dead-lettered at any stage): the data is exhausted. ``resume.FeedChanged`` if the
        checkpoint's finished groups were recorded against another feed's order."""
        self._order = list(group_ids)
        self.done_groups |= resume.finished(self.state, self._order)
        self.expected = set(self._order)
        self._remaining = self.expected - self.done_groups
        self._group_size = group_size
        if self.state.ended == "data_exhausted" and self._remaining:
            self.state.ended = ""  # more data than when it ended (more epochs): go on

    def validate(self) -> None:
        self.cfg.validate()

    def describe(self) -> str:
        return (f"version {self.version}, group {self.group}, checkpoints in "
                f"{self.cfg.checkpoint_dir}, {self.trainer.world} rank(s), "
                f"{self.trainer.memory_estimate['total'] / 2**20:.1f} MB per rank for weights, gradients, AdamW; "
                f"{self.trainer.packing_note}")

    @property
    def version(self) -> int:
        return self.state.version

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        """Read on from the offsets of the checkpoint the weights came from (unless the topics
        are new: a resumed run on the embedded broker, whose old topics are gone)."""
        if not self.cfg.checkpoint_offsets:
            return
        for tp in assigned:
            offset = self.state.offsets.get(str(tp.partition))
            if offset is not None:
                self.consumer.seek(tp, offset)

    def _revoked(self, revoked: set[TopicPartition]) -> None:
        """A rebalance took partitions away while the learner runs: another member joined its
        group. The learner's own leaving (``consumer.stop``) revokes them too: not a warning."""
        if revoked and not self._leaving:
            log.warning("learner: partitions revoked (%s); is a second learner in group %r?",
                        sorted(tp.partition for tp in revoked), self.group)

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> resume.LearnerState:
        """Train until ``cfg.versions`` is reached (0: forever) or ``stop`` is set; then
        checkpoint and leave. Cancelling the task is a crash: no checkpoint."""
        stop = stop or asyncio.Event()
        await self.producer.start()
        await self.consumer.start()
        if self.expected is not None:
            self._dead = Reader(self.bus, ["deadletter"], STAGE)
            await self._dead.start()
        clean = False
        try:
            await self._announce_current()
            while not stop.is_set() and not self._done():
                started = time.monotonic()
                trained = False
                for msg in await self.consumer.getmany(timeout_ms=100):
                    await self._take(msg)
                await self._drop(self.assembler.expire(time.monotonic()))
                await self._read_dead_letters()
                if self._data_ended():
                    await self._finish_data()
                    break
                while not stop.is_set() and not self._done():
                    groups, drops = self.assembler.take(self.cfg.groups_per_mini_batch, self.version)
                    await self._drop(drops)
                    if groups is None:
                        break
                    await self._train(groups)
                    trained = True
                if not trained:
                    metrics.LEARNER_STARVED_SECONDS.inc(time.monotonic() - started)
                metrics.waiting(STAGE, None if trained else self._waiting_on())
            if self.cfg.versions and self.version >= self.cfg.versions and not self.state.ended:
                self.state.ended = "versions"  # in the next checkpoint, if any (none is written for it)
            clean = True
        finally:
            try:
                if clean and self._dirty:
                    await self._checkpoint()
            finally:
                if self._dead is not None:
                    await self._dead.stop()
                self._leaving = True
                await self.consumer.stop()
                await self.producer.stop()
        if self.state.ended:
            log.warning("learner: ended (%s) at version %d, %d records trained", self.state.ended,
                        self.version, self.state.trained_records)
        return self.state

    def _done(self) -> bool:
        return (bool(self.cfg.versions) and self.version >= self.cfg.versions) or self.state.ended == "data_exhausted"

    def _waiting_on(self) -> str:
        """What the learner waits for when it did not train: groups to fill, groups with variance
        (dynamic sampling filtered all it got since the last version), or records."""
        if any(not g.complete for g in self.assembler.open.values()):
            return "incomplete_groups"
        if self.assembler.filtered and not self.assembler.ready:
            return "filtered_groups"
        return "records"

    # -- the end of the data --------------------------------------------------------------------
    def _group_done(self, gid: str) -> None:
        if gid not in self.done_groups:
            self.done_groups.add(gid)  # into the checkpoint's state when it is saved
            self._lost.pop(gid, None)
            self._sizes.pop(gid, None)
        self._remaining.discard(gid)

    async def _lose(self, gid: str | None, rid: str | None, size: int | None = None) -> None:
        """A member of group ``gid`` will never reach training (dead-lettered here or upstream);
        ``rid`` None: the whole group (its prompt was dead-lettered). Once every member is
        accounted for, the group is settled now rather than at its timeout."""
        if not gid or gid in self.done_groups or self.expected is None:
            return
        if size:
            self._sizes.setdefault(gid, size)
        self._lost.setdefault(gid, set()).add("*" if rid is None else rid)
        await self._settle(gid)

    async def _settle(self, gid: str) -> None:
        lost = self._lost.get(gid)
        if not lost or gid in self.done_groups:
            return
        group = self.assembler.open.get(gid)
        if "*" not in lost:
            held = {i.id for i in group.items} if group is not None else set()
            size = group.group_size if group is not None else self._sizes.get(gid, self._group_size)
            if len(held | lost) < size:
                return
        if group is not None:
            await self._drop(self.assembler.settle(gid, f"{len(lost)} members dead-lettered before training"))
        elif gid not in self.assembler.closed:
            self.assembler.close(gid, "members_lost")  # late members (a redelivery) are dropped
            self._group_done(gid)

    async def _read_dead_letters(self) -> None:
        """Dead letters of other stages (a prompt the rollout worker refused, a trajectory the
        reward stage could not score): their groups will never be whole."""
        if self._dead is None:
            return
        prompts, rollouts = self.bus.topic("prompts"), self.bus.topic("rollouts")
        for msg in await self._dead.fetch(timeout_ms=0):
            try:
                letter = DeadLetter.decode(msg.value, DeadLetter.size_limit(self.bus.config.max_record_bytes))
            except RecordError:
                continue
            if letter.source_topic not in (prompts, rollouts):
                continue  # the learner's own (it counted them when it sent them)
            key = base64.b64decode(letter.original_key_b64).decode(errors="replace") if letter.original_key_b64 else None
            size = None
            if letter.source_topic == rollouts:
                try:
                    size = Trajectory.decode(letter.original_value(), self.bus.config.max_record_bytes).group_size
                except (RecordError, TypeError):
                    pass
            await self._lose(key, letter.record_id if letter.source_topic == rollouts else None, size)

    def _data_ended(self) -> bool:
        """Every group of the feed is finished, or whole and waiting to be trained."""
        if self.expected is None or len(self._remaining) > len(self.assembler.ready):
            return False
        return self._remaining <= set(self.assembler.ready)

    async def _finish_data(self) -> None:
        """Train what is ready (the last mini-batch may be smaller), publish the last version
        (it may hold fewer mini-batches) and mark the end; ``run`` checkpoints."""
        while self.assembler.ready:
            n = min(self.cfg.groups_per_mini_batch, len(self.assembler.ready))
            groups, drops = self.assembler.take(n, self.version)
            await self._drop(drops)
            if groups:
                await self._train(groups)
        self._final = True
        if self.state.mini_batches:
            await self._finish_version()
        elif self._last is not None:  # the last version is out already: say it was the last
            await self.producer.send_and_wait(dataclasses.replace(self._last, metrics={}, final=True))
        self.state.ended, self._dirty = "data_exhausted", True

    # -- taking records -----------------------------------------------------------------------
    async def _take(self, msg: Message) -> None:
        tp = TopicPartition(msg.topic, msg.partition)
        if self.checkpointer.holds(tp, msg.offset):
            return  # the same message again (a seek after a rebalance): it is already held
        self.checkpointer.take(tp, msg.offset, msg.timestamp)
        self._dirty = True
        record = None
        try:
            record = self.source.decode(msg.value, self.bus.config.max_record_bytes)
            sample = self._sample(record)
        except RecordError as exc:
            await self._dead_letter(msg, exc.reason, exc.detail, getattr(record, "id", None))
            gid = record.group_id if record is not None else (msg.key or b"").decode(errors="replace")
            await self._lose(gid, getattr(record, "id", None) or f"offset:{msg.partition}:{msg.offset}",
                             getattr(record, "group_size", None))
            return
        if self._abandoned(record):
            await self._dead_letter(msg, "abandoned_line", f"generated by version {record.policy_version} of line "
                                    f"{record.lineage}, abandoned after version {self.state.abandoned[record.lineage]}",
                                    record.id)
            await self._lose(record.group_id, record.id, record.group_size)
            return
        item = Item(record.id, record.group_id, record.group_size, record.policy_version,
                    _Taken(sample, msg, record), copy=record.created_at, metric=filter_metric(record, self.cfg))
        status, drops = self.assembler.add(item, self.version, time.monotonic())
        if status == "duplicate":
            metrics.LEARNER_RECORDS.labels("duplicate").inc()
            self.checkpointer.done(tp, msg.offset)
        elif status == "regenerated":  # a trajectory produced twice: the gate counts it finished
            await self._dead_letter(msg, "regenerated", f"another copy of {record.id} (created at "
                                    f"{record.created_at:.3f}) was taken first: its rollout worker generated "
                                    f"group {record.group_id} again (a restart before its prompt was committed)",
                                    record.id)
        await self._drop(drops)
        if record.group_id in self._lost:
            await self._settle(record.group_id)

    def _abandoned(self, record: Rewarded) -> bool:
        """Generated by a version of a line this learner abandoned (it restarted from an older
        checkpoint): those weights exist no more, so the record is not trained on."""
        kept = self.state.abandoned.get(record.lineage or "")
        return kept is not None and record.policy_version > kept

    def _sample(self, record: Rewarded):
        """The record as a training sample, or ``RecordError`` saying why it cannot be one."""
        return to_sample(record, self.cfg, self.trainer.model.get_input_embeddings().num_embeddings,
                         self.trainer.tokenizer, self.trainer.route_shape)

    async def _drop(self, drops: list[Drop]) -> None:
        for d in drops:
            if d.closes_group:
                metrics.LEARNER_GROUPS.labels(d.reason).inc()
            taken: _Taken = d.item.payload
            await self._dead_letter(taken.message, d.reason, d.detail, d.item.id)
            if d.item.group_id not in self.assembler.open:
                self._group_done(d.item.group_id)

    async def _dead_letter(self, msg: Message, reason: str, detail: str, record_id: str | None) -> None:
        fut = await self.producer.dead_letter(reason=reason, detail=detail, message=msg, record_id=record_id,
                                              routine=reason == FILTERED)
        self.checkpointer.done_when_acked(fut, TopicPartition(msg.topic, msg.partition), msg.offset)
        self.state.consumed_records += 1
        self._version_dead += reason != FILTERED
        metrics.LEARNER_RECORDS.labels("dropped").inc()
        metrics.LEARNER_DROPPED.labels(reason).inc()
        self._dirty = True

    # -- training -----------------------------------------------------------------------------
    async def _train(self, groups: list[Group]) -> None:
        taken: list[_Taken] = [item.payload for g in groups for item in g.items]
        observe_staleness([t.record for t in taken], self.version)
        for g in groups:
            metrics.LEARNER_GROUPS.labels("partial" if len(g.items) < g.items[0].group_size else "trained").inc()
        trained = remax_baselines([[t for t in (i.payload for i in g.items)] for g in groups],
                                  self.cfg.adv_estimator == "remax")
        out = await asyncio.to_thread(self._step, [t.sample for t in trained])
        for g in groups:
            self._group_done(g.group_id)
        if out.get("skipped_steps"):  # a non-finite gradient: the update was not applied
            for t in taken:
                await self._dead_letter(t.message, "non_finite_gradient",
                                        "the update on this mini-batch was skipped", t.record.id)
            return
        for t in taken:
            self.checkpointer.done(TopicPartition(t.message.topic, t.message.partition), t.message.offset)
        n = len(taken)
        metrics.CONSUMER_LAST_PROGRESS.labels(STAGE, self.group).set(time.time())
        self.state.consumed_records += n
        self.state.trained_records += n
        self.state.mini_batches += 1
        self._dirty = True
        observe_update(out, n)
        figures = record_figures([t.record for t in trained], self.version)
        if "rewards_mean" in out:  # the KL is in the reward: the trainer's rewards, not the scores
            figures = {k: v for k, v in figures.items() if not k.startswith("rewards_")}
        self._version_metrics.append({**figures, **out})
        if self.state.mini_batches >= self.cfg.mini_batches_per_version:
            await self._finish_version()

    def _step(self, samples: list[Any]) -> dict[str, float]:
        """The update, in the thread every collective call runs in: the lr schedule's step (the
        version), then the mini-batch."""
        self.trainer.set_version(self.version)
        return self.trainer.step(samples)

    async def _finish_version(self) -> None:
        self.state.version += 1
        self.state.mini_batches = 0
        summary = mean_metrics(self._version_metrics)
        took = time.monotonic() - self._version_started
        summary.update(version_seconds=took, dead_letters=float(self._version_dead))
        if "total_tokens" in summary and took > 0:  # verl's perf/throughput: tokens per second per rank
            summary["throughput"] = summary["total_tokens"] / took / self.trainer.world
        self._version_started, self._version_dead = time.monotonic(), 0
        if self.cfg.filter_groups.enable:
            summary["filtered_groups"] = float(self.assembler.filtered)
        self.assembler.new_version(self.version, time.monotonic())  # and forget what is old enough
        metrics.LEARNER_DEDUP_IDS.set(len(self.assembler.finished))
        self._version_metrics = []
        self.state.summary = summary
        metrics.LEARNER_VERSION.set(self.version)
        if self.cfg.checkpoint_every and self.version % self.cfg.checkpoint_every == 0:
            await self._checkpoint()
        await self._announce(self.version, summary)
        await self._drop(self.assembler.purge_stale(self.version))

    # -- versions and checkpoints -------------------------------------------------------------
    async def _announce(self, version: int, summary: dict[str, float]) -> PolicyVersion:
        """Write the weights to ``<weights_dir>/v<version>`` and publish the version."""
        target = Path(self.cfg.weights_dir) / f"v{version}"
        fields: dict[str, Any] = {}
        with full_storage_stops("the weights of version", version, self.cfg.weights_uri or self.cfg.weights_dir,
                                "learner.keep_weights", leftovers=target):
            path = await asyncio.to_thread(self.trainer.save_weights, target)  # gathered from the shards
            if self._delta is not None:  # the full version as written, turned into a delta where one can be
                published = await asyncio.to_thread(publish_delta, self._delta, path, version)
                fields, summary = published["fields"], {**summary, **published["metrics"]}
            uri = str(path.resolve())
            if self.cfg.weights_uri:  # for rollout workers on other nodes: announced once uploaded
                from streamrl import weights

                uri = await asyncio.to_thread(weights.upload, path,
                                              weights.version_uri(self.cfg.weights_uri, version))
        final = self._final or bool(self.cfg.versions and version >= self.cfg.versions)
        if self._base_uri is None:
            self._base_uri = await asyncio.to_thread(publish_base, self.trainer, self.cfg)
        record = PolicyVersion(version=version, weights_uri=uri, base_uri=self._base_uri or None,
                               trained_records=self.state.trained_records, metrics=summary,
                               lineage=self.state.lineage, final=final, **fields)
        await self.producer.send_and_wait(record)
        self._last = record
        log.info("learner: version %d at %s (%d records trained)", version, uri, self.state.trained_records)
        await asyncio.to_thread(prune_weights, self.cfg, version)
        return record

    async def _announce_current(self) -> None:
        """At start: make sure ``policy`` names the weights this learner starts from, so rollout
        workers and the learner agree (version 0 on a fresh run)."""
        latest = await read_latest_policy(self.bus)
        if start_line(self.state, latest):
            await self._checkpoint()  # the new line is on disk before anything is trained on it
            await self._announce(self.version, {})
        elif latest is None or latest.version < self.version:  # killed between checkpoint and announcement
            await self._announce(self.version, self.state.summary)
        else:
            self._last = latest  # ours (same line and version): what a final mark repeats

    async def _checkpoint(self) -> Path:
        """Dead letters acknowledged, then the checkpoint (weights, optimizer, version, offsets,
        de-duplication window) saved, then the same offsets committed to Kafka."""
        started = time.monotonic()
        saved: list[Path] = []

        async def save(positions: dict[TopicPartition, int]) -> None:
            offsets = dict(self.state.offsets)
            offsets.update({str(tp.partition): off for tp, off in positions.items()})
            self.state.offsets = offsets
            self.state.assembler = self.assembler.state_dict()
            resume.pack_finished(self.state, self.done_groups, self._order)
            with full_storage_stops("the checkpoint of version", self.version, self.cfg.checkpoint_dir,
                                    "learner.keep_checkpoints"):
                saved.append(await asyncio.to_thread(
                    checkpoint.save, self.cfg.checkpoint_dir, self.trainer.model, self.trainer.tokenizer,
                    None, self.state, self.cfg.keep_checkpoints, write=self.trainer.write_checkpoint))

        # every partition taken from, assigned now or not: the checkpoint describes them all
        await self.checkpointer.commit(self.checkpointer.partitions, save=save)
        self.last_checkpoint = saved[0]
        self._dirty = False
        metrics.LEARNER_CHECKPOINT_SECONDS.observe(time.monotonic() - started)
        return saved[0]


def filter_metric(record: Rewarded, cfg) -> float | None:
    """What dynamic sampling compares within a group (``learner.filter_groups.metric``): that
    field of ``reward_info`` (``acc``: a scorer's own), else the reward (verl's ``seq_reward``
    and ``seq_final_reward``, the KL in the reward aside). None when the filter is off."""
    if not cfg.filter_groups.enable:
        return None
    value = (record.reward_info or {}).get(cfg.filter_groups.metric)
    if isinstance(value, (bool, int, float)):
        return float(value)
    return float(record.reward)
