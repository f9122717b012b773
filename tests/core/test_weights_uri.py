"""Weights by URI (``learner.weights_uri``): a version uploaded with fsspec loads into a rollout
worker's model from there, downloaded into a directory that is gone once loaded; old versions are
pruned; the worker's default prefixes take the URI; a URI no filesystem serves fails at start.
The filesystem is fsspec's real in-memory one (``memory://``); tests/supervisor/test_ray_cluster.py runs the
whole job with a ``file://`` URI across two Ray nodes."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from streamrl import weights
from streamrl.bus import Bus
from streamrl.pipeline_config import load_config
from streamrl.errors import ConfigError
from streamrl.learner.config import LearnerConfig
from streamrl.policy import load_policy
from streamrl.weights import save_policy
from streamrl.rollout.backends import WeightLoadError
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.rollout.worker import RolloutWorker, weights_allowed


def memory_uri() -> str:
    return f"memory://streamrl-test-{uuid.uuid4().hex[:8]}/run"


def test_a_version_uploaded_to_a_uri_loads_from_there(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    trained, tok = load_policy("tiny", seed=1)  # "the learner's" weights: not the worker's seed-0 ones
    local = save_policy(trained, tok, tmp_path / "weights" / "v1")
    prefix = memory_uri()
    uri = weights.upload(local, weights.version_uri(prefix, 1))
    assert uri == f"{prefix}/v1"
    backend = TransformersBackend("tiny", seed=0)
    name, before = next(iter(backend.model.state_dict().items()))
    assert not torch.equal(before, trained.state_dict()[name])
    asyncio.run(backend.load_weights(uri, 1))
    assert backend.version == 1
    for key, value in trained.state_dict().items():
        assert torch.equal(backend.model.state_dict()[key], value), key
    assert list((tmp_path / "cache" / "streamrl-weights").iterdir()) == []  # the copy is gone once loaded
    with pytest.raises(WeightLoadError, match=r"cannot download: nothing at memory://"):
        asyncio.run(backend.load_weights(f"{prefix}/v9", 9))
    assert backend.version == 1  # keeps what it has


def test_upload_replaces_a_version_and_prune_keeps_the_newest(tmp_path):
    import fsspec

    prefix = memory_uri()
    fs, root = fsspec.core.url_to_fs(prefix)
    for version in range(1, 6):
        d = tmp_path / f"v{version}"
        (d / "sub").mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * version)
        (d / "sub" / "extra.json").write_text("{}")
        weights.upload(d, weights.version_uri(prefix, version))
    assert fs.cat_file(f"{root}/v3/model.safetensors") == b"xxx" and fs.exists(f"{root}/v3/sub/extra.json")
    again = tmp_path / "again"  # a new line re-announces version 3 with other weights
    again.mkdir()
    (again / "model.safetensors").write_bytes(b"new")
    weights.upload(again, weights.version_uri(prefix, 3))
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/v3")) == ["model.safetensors"]
    weights.prune(prefix, version=5, keep=2)
    assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["v4", "v5"]


def worker_for(cfg) -> RolloutWorker:
    async def build() -> RolloutWorker:  # its Kafka parts want a running loop (nothing connects)
        worker = RolloutWorker.from_config(cfg, Bus(cfg.bus))
        for part in (worker.producer, worker.follower, worker.gate, worker.loop.consumer):
            await part.stop() if asyncio.iscoroutinefunction(part.stop) else part.stop()
        return worker

    return asyncio.run(build())


def test_rollout_workers_accept_the_learners_uri_by_default():
    prefix = memory_uri()
    bus = "bus.bootstrap_servers=127.0.0.1:9"  # built, never connected
    cfg = load_config("local.yaml", [bus, f"learner.weights_uri={prefix}", "learner.weights_dir=/data/w"])
    worker = worker_for(cfg)
    assert worker.cfg.weights_prefixes == ["/data/w", prefix]
    assert weights_allowed(f"{prefix}/v3", worker.cfg.weights_prefixes)
    assert not weights_allowed("memory://elsewhere/v3", worker.cfg.weights_prefixes)
    plain = worker_for(load_config("local.yaml", [bus, "learner.weights_dir=/data/w"]))
    assert plain.cfg.weights_prefixes == ["/data/w"]


def test_a_weights_uri_is_checked_at_start():
    LearnerConfig(weights_uri="memory://bucket/run").validate()
    LearnerConfig(weights_uri="file:///shared/run").validate()
    with pytest.raises(ConfigError, match=r"^config field 'learner.weights_uri': '/shared/run' is not a URI"):
        LearnerConfig(weights_uri="/shared/run").validate()
    with pytest.raises(ConfigError, match=r"^config field 'learner.weights_uri': fsspec knows no filesystem 'nosuch'"):
        LearnerConfig(weights_uri="nosuch://bucket/run").validate()
