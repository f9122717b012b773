"""The two replays: re-score a range of a topic (``replay_topic``), or generate with a policy
checkpoint on held-out prompts and score that (``evaluate_policy``). Both write the same report
(``report.py``) and may publish what they scored to an evaluation topic."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from streamrl import metrics
from streamrl.bus import Bus
from streamrl.chat import ChatRenderer
from streamrl.config import ConfigError
from streamrl.evaluation.scores import response_figures
from streamrl.feed.prompts import build_prompts
from streamrl.pipeline_config import PipelineConfig
from streamrl.records import Rewarded, Trajectory
from streamrl.replay.report import build_report, old_reward, result_row, write_all
from streamrl.replay.rescore import Rescorer, Scored, resolve_scorer
from streamrl.replay.sources import STAGE, Failure, Located, Range, read_archive, read_range
from streamrl.rollout.backends import BackendError, SamplingParams, make_backend
from streamrl.rollout.episode import run_group
from streamrl.rollout.multiturn import MultiTurn
from streamrl.topics import TOPIC_NAMES, ensure_topics, load_specs


def _bar(progress: bool, **kwargs: Any) -> tqdm:
    """A progress bar on stderr (rate and ETA once the total is known)."""
    return tqdm(file=sys.stderr, disable=not progress, dynamic_ncols=True, **kwargs)


async def replay_topic(cfg: PipelineConfig, *, topic: str, scorer: str, out: Path,
                       bounds: Range = Range(), fmt: str = "jsonl", publish_topic: str | None = None,
                       progress: bool = True, archive: str | None = None) -> Path:
    """Re-score ``topic`` (short or full name) within ``bounds`` with ``scorer`` (``rescore``'s
    ``--scorer`` forms); returns the JSON report's path. Joins no group, commits nothing.
    ``archive``: read the topic from that archive (a path or URI) instead: no broker needed."""
    _check_publish_topic(publish_topic)
    bus = Bus(cfg.bus) if publish_topic or not archive else None
    choice = resolve_scorer(scorer, cfg.reward)
    rescorer = Rescorer(choice)  # a bad scorer config fails before anything is read
    keep = publish_topic is not None
    if archive:
        with _bar(progress, desc=f"read {topic} from {archive}", unit="file") as bar:
            read = read_archive(archive, topic, bounds, keep_arrays=keep, progress=bar)
    else:
        assert bus is not None
        with _bar(progress, desc=f"read {topic}", unit="msg") as bar:
            read = await read_range(bus, topic, bounds, keep_arrays=keep, progress=bar)
    metrics.REPLAY_RECORDS.labels("read").inc(read.messages)
    metrics.REPLAY_RECORDS.labels("skipped").inc(read.skipped)
    metrics.REPLAY_RECORDS.labels("duplicate").inc(read.duplicates)
    metrics.REPLAY_RECORDS.labels("decode_failed").inc(len(read.failures))
    scored, versions = await _score(rescorer, [loc.record for loc in read.records], progress)
    rows, failures = _rows(read.records, scored)
    if publish_topic:
        assert bus is not None
        await publish(bus, publish_topic, read.records, scored, source_topic=read.topic)
    report = build_report(
        mode="topic", scorer={"spec": scorer, "entries": versions}, rows=rows,
        source={"topic": read.topic, **({"archive": archive} if archive else {}), **bounds.describe(),
                "partitions": {str(p): list(w) for p, w in sorted(read.window.items())}},
        failures=[f.to_dict() for f in read.failures] + failures,
        messages=read.messages, skipped=read.skipped, duplicates=read.duplicates)
    return write_all(report, rows, out, fmt)


async def evaluate_policy(cfg: PipelineConfig, *, policy: str, prompts: str, scorer: str, out: Path,
                          samples: int = 1, limit: int = 0, policy_version: int = 0, fmt: str = "jsonl",
                          publish_topic: str | None = None, progress: bool = True) -> Path:
    """Generate ``samples`` responses per prompt of ``prompts`` (a dataset: a file or a name, read as
    the prompt feed reads it: ``cfg.feed``'s template and ground truth) with ``policy`` through
    the rollout backend (``cfg.rollout``: backend, sampling), score them with ``scorer`` and
    report; returns the JSON report's path. Needs a broker only to publish.

    The generation is seeded with ``eval.seed`` and goes prompt by prompt, as the eval stage's
    does, and the report carries verl's validation figures (``validation``): the same weights at
    the eval stage's sampling (``rollout.temperature``/``top_p`` = ``eval.*``, ``--samples`` =
    ``eval.n``) give the figure the eval stage published for that version."""
    _check_publish_topic(publish_topic)
    feed = dataclasses.replace(cfg.feed, dataset=prompts, group_size=samples, limit=limit, epochs=1,
                               start_epoch=0, shuffle=False)
    prompt_records = list(build_prompts(feed))  # a bad row fails here, naming file and row
    bus = Bus(cfg.bus) if publish_topic else None
    rescorer = Rescorer(resolve_scorer(scorer, cfg.reward))
    rc = dataclasses.replace(cfg.rollout, policy=policy).validate()
    backend = make_backend(rc)
    await backend.use_starting_weights(policy_version)  # the weights it is on are that version (servers too)
    backend.reseed(cfg.eval.seed)
    params = SamplingParams(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p)
    renderer = ChatRenderer(backend.tokenizer)
    interaction = MultiTurn.from_config(rc)  # the same interactions and tools as the rollout workers
    trajectories: list[Trajectory] = []
    failures: list[dict[str, Any]] = []
    try:
        with _bar(progress, desc="generate", unit="prompt", total=len(prompt_records)) as bar:
            for prompt in prompt_records:
                try:
                    trajectories += await run_group(prompt, samples, backend, params, renderer, interaction)
                except BackendError as exc:
                    failures.append(Failure("generate", "backend_error", str(exc), id=prompt.group_id).to_dict())
                bar.update(1)
    finally:
        await backend.close()
    located = [Located(t, None, None) for t in sorted(trajectories, key=lambda t: t.id)]
    scored, versions = await _score(rescorer, [loc.record for loc in located], progress)
    rows, score_failures = _rows(located, scored)
    if publish_topic:
        assert bus is not None
        await publish(bus, publish_topic, located, scored, source_topic=None)
    report = build_report(
        mode="generate", scorer={"spec": scorer, "entries": versions}, rows=rows,
        source={"policy": policy, "prompts": prompts, "prompt_count": len(prompt_records),
                "samples": samples, "policy_version": policy_version, "backend": rc.backend,
                "max_new_tokens": rc.max_new_tokens, "temperature": rc.temperature, "top_p": rc.top_p},
        failures=failures + score_failures)
    report["validation"] = validation_figures(rows, cfg.eval.seed)
    return write_all(report, rows, out, fmt)


def validation_figures(rows: list[dict[str, Any]], seed: int) -> dict[str, dict[str, float]]:
    """verl's validation figures of the scored rows, by data source (as the eval stage publishes them)."""
    return response_figures([(r["data_source"], r["group_id"], r["new_reward"], r["reward_info"])
                             for r in rows if r["new_reward"] is not None], seed)


async def _score(rescorer: Rescorer, records: list[Trajectory], progress: bool) -> tuple[list[Scored], dict[str, str]]:
    async with rescorer:
        with _bar(progress, desc="score", unit="rec", total=len(records)) as bar:
            scored = await rescorer.score_all(records, bar)
        return scored, rescorer.versions()


def _rows(located: list[Located], scored: list[Scored]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, failures = [], []
    for loc, s in zip(located, scored):
        info = s.info if s.reason is None else {"error": s.reason, "detail": s.detail}
        rows.append(result_row(loc.record, partition=loc.partition, offset=loc.offset,
                               new_reward=s.reward, reward_info=info, scorer=s.scorer))
        if s.reason is not None:
            failures.append(Failure("score", s.reason, s.detail, loc.partition, loc.offset, loc.record.id).to_dict())
    return rows, failures


def _check_publish_topic(name: str | None) -> None:
    """Re-scored records never go back into the pipeline: a learner would train on them."""
    if name in TOPIC_NAMES:
        raise ConfigError(f"--publish-topic {name!r} is a pipeline topic; publish an evaluation "
                          f"to a topic of its own (e.g. rescored.<run>)")


async def ensure_topic(bus: Bus, name: str, like: str = "rewarded") -> bool:
    """Create topic ``name`` (short name) with topic ``like``'s spec unless it exists; True if
    created."""
    [state] = await ensure_topics(bus, specs={name: load_specs()[like]})
    return state.created


async def publish(bus: Bus, topic: str, located: list[Located], scored: list[Scored], *,
                  source_topic: str | None) -> int:
    """Publish every re-scored record to ``topic`` (created like ``rewarded`` if missing) as a
    rewarded record with the new reward; ``reward_info.replay`` says where it came from and
    what it had. Records that failed are in the report, not here. Returns the number sent."""
    await ensure_topic(bus, topic)

    def records():
        for loc, s in zip(located, scored):
            if s.reward is None:
                continue
            rec = loc.record
            origin = {"topic": source_topic, "partition": loc.partition, "offset": loc.offset,
                      "old_reward": old_reward(rec),
                      "old_scorer": rec.scorer if isinstance(rec, Rewarded) else None}
            yield Rewarded.from_trajectory(rec, reward=s.reward, reward_info={**s.info, "replay": origin},
                                           scorer={"name": s.scorer, "version": s.version})

    async with bus.producer(STAGE) as producer:
        sent = await producer.send_all(records(), topic=topic)
    metrics.REPLAY_RECORDS.labels("published").inc(sent)
    return sent
