"""The feed stage: a dataset published once to the prompts topic (``streamrl feed``), resumable
from the learner's checkpoint (read through ``streamrl.resume``)."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

from streamrl import resume
from streamrl.datasets import describe
from streamrl.feed.config import FeedConfig
from streamrl.feed.prompts import build_prompts, feed_group_ids


async def published_group_ids(bus) -> set[str]:
    """The group ids already on the prompts topic (its keys), read to its end without a group."""
    from streamrl.bus import Reader

    async with Reader(bus, ["prompts"], "feed") as reader:
        return {m.key.decode(errors="replace") async for batch in reader.read() for m in batch if m.key}


async def publish_feed(bus, cfg: FeedConfig, *, window: int = 1000, skip: set[str] | None = None) -> int:
    """Publish the feed and wait for every acknowledgement; returns the number published.
    A bad row raises ``FeedError`` before anything is sent. Prompts whose group id is in
    ``skip`` (a resumed run: finished, or already on the topic) are not published."""
    prompts = build_prompts(cfg)
    first = next(prompts, None)  # converts (and so checks) every row
    if first is None:
        return 0
    prompts = itertools.chain([first], prompts)
    if skip:
        prompts = (p for p in prompts if p.group_id not in skip)
    async with bus.producer("feed") as producer:
        return await producer.send_all(prompts, window=window)


class Feed:
    """The feed as a stage: publishes its dataset once and ends."""

    name: ClassVar[str] = "feed"

    def __init__(self, bus: Any, cfg: FeedConfig, checkpoint_dir: str = ""):
        self.bus, self.cfg = bus, cfg
        self.checkpoint_dir = checkpoint_dir  # the learner's: what it finished (feed.resume)

    @classmethod
    def from_config(cls, cfg: Any, bus: Any) -> "Feed":
        return cls(bus, cfg.feed, cfg.learner.checkpoint_dir)

    def validate(self) -> None:
        self.cfg.validate()

    def describe(self) -> str:
        return f"{describe(self.cfg.dataset)} -> {self.bus.topic('prompts')}"

    async def resume_position(self) -> tuple[set[str], int, int]:
        """Where a resumed feed stands: the group ids not to publish again (finished, per the
        learner's newest readable checkpoint, or still on the prompts topic), and how many of
        each. The learner's checkpoint is the feed's position: one source of truth, so a prompt
        is fed again exactly when its group was not trained (or dead-lettered) in the weights
        the run resumes from."""
        good = resume.latest_good(self.checkpoint_dir) if self.checkpoint_dir else None
        done = set()
        if good is not None:  # by position in the feed's order (read only where the state has positions)
            done = resume.finished(good[1], feed_group_ids(self.cfg) if good[1].done_bits else None)
        on_topic = await published_group_ids(self.bus)
        return done | on_topic, len(done), len(on_topic - done)

    async def run(self, stop: Any = None) -> int:
        skip = None
        if self.cfg.resume:
            skip, done, on_topic = await self.resume_position()
            print(f"feed: resuming: {done} groups finished (learner checkpoint), {on_topic} more on "
                  f"{self.bus.topic('prompts')}: not published again", flush=True)
        count = await publish_feed(self.bus, self.cfg, skip=skip)
        print(f"feed: published {count} prompts to {self.bus.topic('prompts')}", flush=True)
        return count
