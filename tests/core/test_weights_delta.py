"""Versions published by delta (``learner.weights_delta``, ``streamrl.weights.delta``): the
learner's own trainer writes a chain of versions (full, deltas, full) in bf16 and fp32, each
published as ``DeltaWriter`` makes it, and readers rebuild every version bit for bit the same as
the full files the learner wrote: in order, joining late, skipping versions, from a local path
and from a URI (fsspec's real in-memory filesystem), through the rollout backend's load. A
corrupt delta or a corrupt base is refused by checksum and the next load comes from the full
version; pruning keeps the versions a kept delta is rebuilt from; ``streamrl export`` writes a
delta version as a whole Hugging Face directory."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import pytest

from streamrl import weights
from streamrl.rollout.backends import WeightLoadError
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.weights import delta
from tests.core.weights_chain import VERSIONS, same_files, train_chain
from tests.helpers import batch, learner_cfg


@pytest.fixture
def fresh_reader(tmp_path, monkeypatch):
    """This test's own reader process state (the bases held) and cache directory."""
    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    reader = delta.Reconstructor()
    monkeypatch.setattr(weights, "reconstructor", reader)
    return reader


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_chain_rebuilds_bit_exact_in_order_late_and_skipping(tmp_path, fresh_reader, dtype):
    published, full = train_chain(tmp_path, dtype)
    for v in range(1, VERSIONS + 1):  # a reader that follows every version
        same_files(weights.weights_path(str(published / f"v{v}")), full / f"v{v}")
    assert fresh_reader.held_version(str(published.resolve())) == VERSIONS

    late = delta.Reconstructor()  # joins at v4: the full v1 and the deltas v2..v4
    out = late.resolve(str((published / "v4").resolve()), published / "v4", delta.read_manifest(published / "v4"),
                       Path)
    assert out.from_full and out.applied == 3
    same_files(out.directory, full / "v4")
    skip = late.resolve(str((published / "v7").resolve()), published / "v7", delta.read_manifest(published / "v7"),
                        Path)  # held v4 is of another chain (v5 is full): rebuilt from v5
    assert skip.from_full and skip.applied == 2
    same_files(skip.directory, full / "v7")

    skipper = delta.Reconstructor()  # v2, then v4 (skipping v3 under staleness): v3 and v4 onto its v2
    skipper.resolve(str((published / "v2").resolve()), published / "v2", delta.read_manifest(published / "v2"), Path)
    out = skipper.resolve(str((published / "v4").resolve()), published / "v4", delta.read_manifest(published / "v4"),
                          Path)
    assert not out.from_full and out.applied == 2
    same_files(out.directory, full / "v4")


def test_bf16_at_an_rl_learning_rate_changes_few_bytes(tmp_path, fresh_reader):
    published, full = train_chain(tmp_path, "bfloat16", lr=1e-5)
    for v in (2, 3, 4, 6, 7):
        manifest = delta.read_manifest(published / f"v{v}")
        sent = sum(f.stat().st_size for f in (published / f"v{v}").glob(f"*{delta.SUFFIX}"))
        whole = sum(f.stat().st_size for f in (full / f"v{v}").glob("*.safetensors"))
        assert manifest["kind"] == "delta" and sent < 0.5 * whole, (v, sent, whole)
        same_files(weights.weights_path(str(published / f"v{v}")), full / f"v{v}")


def test_a_version_by_uri_loads_into_the_backend(tmp_path, fresh_reader):
    import torch
    from safetensors.torch import load_file

    published, full = train_chain(tmp_path, "float32")
    prefix = f"memory://streamrl-delta-{uuid.uuid4().hex[:8]}/run"
    for v in range(1, VERSIONS + 1):
        weights.upload(published / f"v{v}", weights.version_uri(prefix, v))
    backend = TransformersBackend("tiny", seed=0)
    for v in (3, 4, 7):  # late (v1 + deltas), in order, skipping to another chain
        asyncio.run(backend.load_weights(weights.version_uri(prefix, v), v))
        expected = load_file(str(full / f"v{v}" / "model.safetensors"))
        state = backend.model.state_dict()
        for name, value in expected.items():
            assert torch.equal(state[name], value), (v, name)
    assert backend.version == 7
    downloads = [p for p in (tmp_path / "cache" / "streamrl-weights").iterdir() if not p.name.startswith("full-")]
    assert downloads == []  # the deltas' downloads are gone once applied; the rebuilt versions stay


def test_a_corrupt_delta_is_refused_then_the_full_version_loads(tmp_path, fresh_reader):
    published, full = train_chain(tmp_path, "float32")
    same_files(weights.weights_path(str(published / "v2")), full / "v2")
    frame = published / "v3" / f"model.safetensors{delta.SUFFIX}"
    data = bytearray(frame.read_bytes())
    data[len(data) // 2] ^= 0xFF
    frame.write_bytes(bytes(data))
    with pytest.raises(WeightLoadError, match="cannot reconstruct"):
        weights.weights_path(str(published / "v3"))
    assert fresh_reader.held_version(str(published.resolve())) is None  # what it held is forgotten
    with pytest.raises(WeightLoadError):  # the retry rebuilds from v1: v3 is still corrupt there
        weights.weights_path(str(published / "v4"))
    same_files(weights.weights_path(str(published / "v5")), full / "v5")  # the next full version loads
    same_files(weights.weights_path(str(published / "v6")), full / "v6")


def test_a_corrupt_base_is_refused_by_checksum_and_the_retry_rebuilds_from_full(tmp_path, fresh_reader):
    published, full = train_chain(tmp_path, "bfloat16")
    weights.weights_path(str(published / "v2"))
    held = fresh_reader._held[str(published.resolve())]
    held.files["model.safetensors"][-1] ^= 0x01  # the reader's copy of v2 damaged in memory
    with pytest.raises(WeightLoadError, match="checksum"):
        weights.weights_path(str(published / "v3"))
    same_files(weights.weights_path(str(published / "v3")), full / "v3")  # the retry: v1, v2, v3


def test_a_missing_delta_fails_the_load_naming_it(tmp_path, fresh_reader):
    published, _ = train_chain(tmp_path, "float32")
    shutil.rmtree(published / "v3")
    with pytest.raises(WeightLoadError, match="v3"):
        weights.weights_path(str(published / "v4"))


def test_pruning_keeps_the_chain_of_every_kept_delta(tmp_path):
    import fsspec

    published, _ = train_chain(tmp_path, "float32")
    prefix = f"memory://streamrl-prune-{uuid.uuid4().hex[:8]}/run"
    for v in range(1, VERSIONS + 1):
        weights.upload(published / f"v{v}", weights.version_uri(prefix, v))
    fs, root = fsspec.core.url_to_fs(prefix)

    def left(where: str) -> list[int]:
        if "://" in where:
            return sorted(int(p.rstrip("/").rsplit("/v", 1)[1]) for p in fs.ls(root, detail=False))
        return sorted(int(p.name[1:]) for p in Path(where).glob("v*"))

    for where in (str(published), prefix):
        weights.prune(where, version=4, keep=1)  # v4 is a delta on v3, v2, from v1: all needed
        assert left(where) == [1, 2, 3, 4, 5, 6, 7]
        weights.prune(where, version=6, keep=1)  # v6 is a delta on v5 (full): v1..v4 go
        assert left(where) == [5, 6, 7]
        weights.prune(where, version=7, keep=1, keep_every=6)  # v6 kept: its base v5 too
        assert left(where) == [5, 6, 7]


def test_export_writes_a_delta_version_whole(tmp_path, fresh_reader):
    from streamrl.commands import export  # noqa: F401 - the verb's module imports

    published, full = train_chain(tmp_path, "bfloat16")
    out = weights.export_version(published / "v3", tmp_path / "export")
    same_files(out, full / "v3")
    assert json.loads((out / "config.json").read_text())["model_type"]


def test_a_layout_change_or_a_gap_publishes_full(tmp_path):
    from streamrl.learner.trainer import Trainer

    trainer = Trainer(learner_cfg(tmp_path, lr=1e-3))
    writer = delta.DeltaWriter(full_every=10, keep_every=3)
    kinds = []
    for v in (1, 2, 3, 4, 6):  # v3: a keep_every multiple; v6 after a gap (v5 never published)
        trainer.step(batch(v))
        kinds.append(writer.publish(trainer.save_weights(tmp_path / "w" / f"v{v}"), v).kind)
    assert kinds == ["full", "delta", "full", "delta", "full"]
    trainer.model.to(dtype=__import__("torch").bfloat16)  # a dtype change: the layout differs
    assert writer.publish(trainer.save_weights(tmp_path / "w" / "v7"), 7).kind == "full"


def test_a_published_delta_version_loads_as_a_policy(tmp_path, fresh_reader):
    """The teacher's model named as a version directory that is a delta (``local_policy``)."""
    import torch
    from safetensors.torch import load_file

    from streamrl.policy import load_policy

    published, full = train_chain(tmp_path, "float32")
    model, _ = load_policy(weights.local_policy(str(published / "v6")))
    expected = load_file(str(full / "v6" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[n], t) for n, t in expected.items())


def test_apply_streams_tensors_larger_than_its_chunk_bit_exact_and_refuses_a_payload_of_the_wrong_size():
    """``apply`` decompresses a dense tensor's byte planes ``CHUNK`` bytes at a time: tensors of
    more than one chunk with a tail, of element widths 1, 2, 4 and 8, dense and sparse and
    unchanged, rebuild the new file bit for bit; a table that names more or fewer bytes than
    the payload holds is refused. ``encode`` writes each segment straight into one payload: its
    frame is that payload compressed at once, the size in its header (earlier readers decompress
    it in one go)."""
    import numpy as np
    import zstandard
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    n = 2 * delta.CHUNK + 7
    old = {"f32": rng.normal(0, 0.02, n).astype(np.float32), "f64": rng.normal(0, 1, 1000),
           "u8": rng.integers(0, 256, n, dtype=np.uint8), "i16": rng.integers(-2**15, 2**15, (3, n // 3 + 5), dtype=np.int16),
           "f32_same": rng.normal(0, 1, (5, 7)).astype(np.float32)}
    new = dict(old, f32=old["f32"] + rng.normal(0, 1e-6, n).astype(np.float32), u8=old["u8"] ^ np.uint8(1),
               f64=old["f64"] + rng.normal(0, 1e-3, 1000))
    new["i16"] = old["i16"].copy()
    new["i16"][1, ::97] += 1  # a few elements: sparse
    base, target = (np.frombuffer(save(s), np.uint8) for s in (old, new))
    frame, table = delta.encode(base, target)
    assert {row[0]: row[1] for row in table} == {"f32": "d", "f64": "d", "u8": "d", "i16": "s"}
    payload = zstandard.ZstdDecompressor().decompress(frame)  # one-shot, as earlier readers do: the size is in the header
    assert len(payload) == sum(row[3] for row in table)
    assert zstandard.ZstdCompressor(level=1).compress(payload) == frame
    rebuilt = base.copy()
    delta.apply(rebuilt, frame, table)
    assert np.array_equal(rebuilt, target)

    with pytest.raises(delta.DeltaError, match="shorter"):  # the table names a segment the payload lacks
        delta.apply(base.copy(), frame, [*table, ["f32_same", "d", 35, 140]])
    with pytest.raises(delta.DeltaError, match="longer"):  # the payload holds more than the table names
        delta.apply(base.copy(), frame, [row for row in table if row[0] != "u8"])
