"""The learner publishing by delta (``learner.weights_delta: on``) on the in-memory bus: its first
version is full and the next ones deltas on the one before, announced with their base; a reader
rebuilds each into the learner's own weights; a learner resumed after a delta publishes a full
version first (no reader could hold a base of the new process), and the delta before it still
rebuilds from its chain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from streamrl import metrics, weights
from streamrl.learner.stage import Learner
from streamrl.records import PolicyVersion
from streamrl.weights import delta, iter_safetensors
from tests.helpers import group, learner_cfg, publish, read_topic, wait_for


def same_as_model(directory, model) -> None:
    state = model.state_dict()
    loaded = dict(iter_safetensors(directory))
    assert loaded and all(torch.equal(value, state[name]) for name, value in loaded.items())


def test_versions_by_delta_and_a_resume_after_a_delta(memory_bus, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "reconstructor", delta.Reconstructor())
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, versions=0, weights_delta="on", lr=1e-3)
    delta_bytes = metrics.LEARNER_WEIGHTS_BYTES.labels("delta")
    before = delta_bytes._value.get()
    held: dict[int, str] = {}

    async def life(groups: list[str], until: int) -> Learner:
        learner = Learner(bus, cfg)
        stop = asyncio.Event()
        task = asyncio.create_task(learner.run(stop))
        await publish(bus, [r for g in groups for r in group(g, version=learner.version)])
        # announced: its weights written (and turned into a delta) and the version sent; the count
        # moves first, and a loaded CI machine took over the 0.5 s this once slept after it
        await wait_for(lambda: learner._last is not None and learner._last.version == until, timeout_s=120,
                       what=f"version {until} announced")
        path = weights.weights_path(str(tmp_path / "weights" / f"v{until}"))
        same_as_model(path, learner.trainer.model)  # what a reader rebuilds is the learner's weights
        held[until] = str(path)
        stop.set()
        await asyncio.wait_for(task, 60)
        return learner

    asyncio.run(life(["g1", "g2"], 2))
    announced = {p.version: p for p in (PolicyVersion.decode(m.value) for m in asyncio.run(read_topic(bus, "policy")))}
    assert (announced[0].delta_base, announced[0].delta_full) == (None, None)  # the run's first: full
    assert (announced[1].delta_base, announced[1].delta_full) == (0, 0)
    assert (announced[2].delta_base, announced[2].delta_full) == (1, 0)
    assert delta.read_manifest(tmp_path / "weights" / "v2")["kind"] == "delta"
    assert delta_bytes._value.get() > before
    assert 0 < announced[2].metrics["weights/delta_share"] < 1

    resumed = asyncio.run(life(["g3"], 3))  # resumed from the checkpoint at v2 (a delta)
    assert resumed.resumed_from is not None
    last = PolicyVersion.decode(asyncio.run(read_topic(bus, "policy"))[-1].value)
    assert last.version == 3 and last.delta_base is None  # the first of a process: full
    assert delta.read_manifest(tmp_path / "weights" / "v3")["kind"] == "full"

    late = delta.Reconstructor()  # a reader that joins now still rebuilds v2 from v0, v1
    v2 = tmp_path / "weights" / "v2"
    out = late.resolve(str(v2.resolve()), v2, delta.read_manifest(v2), Path)
    assert out.from_full and out.applied == 2
    for name in ("model.safetensors",):
        assert (out.directory / name).read_bytes() == (Path(held[2]) / name).read_bytes()


def test_bad_delta_settings_fail_at_start_naming_the_field(tmp_path):
    from streamrl.errors import ConfigError

    with pytest.raises(ConfigError, match="weights_delta"):
        learner_cfg(tmp_path, weights_delta="sometimes")
    with pytest.raises(ConfigError, match="weights_full_every"):
        learner_cfg(tmp_path, weights_full_every=0)
    with pytest.raises(ConfigError, match="weights_delta_level"):
        learner_cfg(tmp_path, weights_delta_level=30)
    assert learner_cfg(tmp_path).delta_on is False  # auto, no weights_uri: off
    assert learner_cfg(tmp_path, weights_uri="memory://x/run").delta_on is True
    assert learner_cfg(tmp_path, weights_uri="memory://x/run", weights_delta="off").delta_on is False
    from streamrl.learner.config import LoraConfig
    from streamrl.learner.versions import delta_writer

    assert delta_writer(learner_cfg(tmp_path, weights_delta="on")) is not None
    lora = LoraConfig(rank=8)
    assert delta_writer(learner_cfg(tmp_path, weights_delta="on", lora=lora)) is None  # adapters stay as they are
    merged = LoraConfig(rank=8, merge_for_servers=True)
    assert delta_writer(learner_cfg(tmp_path, weights_delta="on", lora=merged)) is not None  # full merged weights
