"""Versions published by delta (``learner.weights_delta: on``) from a learner of two FSDP2 ranks
(gloo on CPU, two real processes; rank 1 follows as under ``streamrl learner``): rank 0 alone
encodes, the model gathered from the shards, so the chain (full, deltas, full) does not depend
on the rank count; a reader rebuilds every version, bit for bit, into the weights the two ranks
held at it, also when it joins late, skips versions, or crosses a resume (a new Trainer on both
ranks from the checkpoint of a delta: its first version is full).

Two ranks' weights are not compared with one process's bytes: the gradients' sums over ranks
round differently (the first trained version already differs in the last bits in fp32), so
the check is bit-exact reconstruction of what the two ranks held."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from streamrl import weights
from streamrl.net import free_port
from streamrl.records import Rewarded
from streamrl.weights import delta, iter_safetensors
from tests.helpers import follow_then_exit, group, learner_cfg

#: its two cases on one worker (each is two rank processes of its own on a 2-core machine)
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("learner-ranks")]

FULL_EVERY = 3
FIRST, SECOND = 4, 2  # versions trained before the resume, and after it
#: what each version is published as: v0 (the run's first) full, a full every FULL_EVERY, the
#: first version after the resume full (no reader could hold a base of the new process)
KINDS = ["full", "delta", "delta", "full", "delta", "full", "delta"]
WEIGHTS = "model.safetensors"
LR = {"float32": 1e-3, "bfloat16": 1e-5}  # bf16 at an RL learning rate: most weights do not change
SHARE = {"float32": 0.9, "bfloat16": 0.25}  # a delta's bytes over the full version's (measured: 0.75-0.78, 0.05-0.13)


def config(root: Path, dtype: str):
    return learner_cfg(root, groups_per_mini_batch=1, versions=0, dtype=dtype, lr=LR[dtype], weights_delta="on",
                       weights_full_every=FULL_EVERY, weights_uri=f"file://{root / 'published'}",
                       keep_weights=2 * len(KINDS),  # every version stays: each is checked after the run
                       checkpoint_every=0)  # a checkpoint when a life stops (the resume), not every version


def _rank(rank: int, port: int, tmp: str, dtype: str, records: list[list[bytes]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if rank:
        # its own directories in its config: it writes only where rank 0 tells it (the checkpoint's
        # shards), never a version of its own
        follow_then_exit(config(Path(tmp) / "rank1", dtype))
    asyncio.run(_lead(Path(tmp), dtype, [[Rewarded.decode(r) for r in g] for g in records]))


async def _lead(tmp: Path, dtype: str, groups: list[list[Rewarded]]) -> None:
    """Rank 0: the learner stage on an in-process bus, trained FIRST versions, then resumed for
    SECOND more; each version's files as rank 0 wrote them from the gathered shards are kept
    (``truth/v<N>``) before they are turned into a delta; the lives and announcements reported."""
    from streamrl.learner import distributed, stage
    from streamrl.learner.stage import Learner
    from streamrl.records import PolicyVersion
    from streamrl.testing import memory_bus
    from tests.helpers import publish, read_topic, wait_for

    real = stage.publish_delta

    def keep_then_publish(writer, path: Path, version: int):
        (tmp / "truth" / f"v{version}").mkdir(parents=True)
        shutil.copy2(path / WEIGHTS, tmp / "truth" / f"v{version}" / WEIGHTS)
        return real(writer, path, version)

    stage.publish_delta = keep_then_publish  # (this process is rank 0's own)
    bus = memory_bus(commit_interval_s=0.2)
    cfg = config(tmp, dtype)
    lives = []
    for versions in (FIRST, SECOND):
        learner = Learner(bus, cfg)  # the second: resumed on both ranks from the checkpoint of a delta
        lives.append({"world": learner.trainer.world, "resumed": learner.resumed_from is not None,
                      "start": learner.version})
        stop = asyncio.Event()
        task = asyncio.create_task(learner.run(stop))
        until = learner.version + versions
        while learner.version < until:
            await publish(bus, groups.pop(0))
            await wait_for(lambda v=learner.version: learner.version > v, timeout_s=120, what="a version")
        await wait_for(lambda: learner._last is not None and learner._last.version == until, timeout_s=60,
                       what=f"version {until} announced")
        stop.set()
        await asyncio.wait_for(task, 60)
    announced = [PolicyVersion.decode(m.value) for m in await read_topic(bus, "policy")]
    (tmp / "out.json").write_text(json.dumps({"lives": lives, "announced": [
        {"version": p.version, "uri": p.weights_uri, "base": p.delta_base, "full": p.delta_full} for p in announced]}))
    distributed.finish()


@pytest.mark.parametrize("dtype", list(LR))
def test_two_fsdp_ranks_publish_a_delta_chain_that_rebuilds_bit_exactly(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    # one group a version, generated by the version that trains it (version i trains group i)
    records = [[r.encode() for r in group(f"g{i}", version=i)] for i in range(FIRST + SECOND)]
    mp.spawn(_rank, args=(free_port(), str(tmp_path), dtype, records), nprocs=2, join=True)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["lives"] == [{"world": 2, "resumed": False, "start": 0},
                            {"world": 2, "resumed": True, "start": FIRST}], out["lives"]
    assert not (tmp_path / "rank1").exists()  # rank 1 published nothing of its own

    # the announcements and the published files: full / delta as configured, each delta on the
    # version before it and its chain's full version
    published = tmp_path / "published"
    announced = {a["version"]: a for a in out["announced"]}
    assert sorted(announced) == list(range(len(KINDS)))
    fulls = [v for v, kind in enumerate(KINDS) if kind == "full"]
    for v, kind in enumerate(KINDS):
        manifest = delta.read_manifest(published / f"v{v}")
        assert manifest["kind"] == kind, (v, manifest["kind"])
        assert announced[v]["uri"] == f"file://{published / f'v{v}'}"
        chain = max(f for f in fulls if f <= v)
        assert (announced[v]["base"], announced[v]["full"]) == ((v - 1, chain) if kind == "delta" else (None, None))
        files = {f.name for f in (published / f"v{v}").iterdir()}
        local = tmp_path / "weights" / f"v{v}"  # learner.weights_dir: the same files as uploaded
        assert {f.name: f.read_bytes() for f in local.iterdir()} == {n: (published / f"v{v}" / n).read_bytes() for n in files}
        assert (WEIGHTS in files, f"{WEIGHTS}{delta.SUFFIX}" in files) == (kind == "full", kind == "delta"), (v, files)
        if kind == "delta":
            assert (manifest["base_version"], manifest["full_version"]) == (v - 1, chain)
            share = (published / f"v{v}" / f"{WEIGHTS}{delta.SUFFIX}").stat().st_size / manifest["files"][WEIGHTS]["size"]
            assert share < SHARE[dtype], (v, share)
    truth = {v: (tmp_path / "truth" / f"v{v}" / WEIGHTS).read_bytes() for v in range(len(KINDS))}
    assert len(set(truth.values())) == len(KINDS)  # every version moved the weights: each delta has work

    def rebuilt(reader: delta.Reconstructor, v: int) -> bytes:
        monkeypatch.setattr(weights, "reconstructor", reader)
        return (weights.weights_path(announced[v]["uri"]) / WEIGHTS).read_bytes()

    # a reader that follows every version (holding each as the next one's base)
    follower = delta.Reconstructor()
    for v in range(len(KINDS)):
        assert rebuilt(follower, v) == truth[v], f"v{v} as rebuilt differs from the learner's"
        assert follower.held_version(str(published)) == v
    # readers that join late or skip versions, across the resume: never a wrong weight
    for path in ([2], [1, 4], [4, 6], [2, 6], [6], [0, 5, 6]):
        reader = delta.Reconstructor()
        for v in path:
            assert rebuilt(reader, v) == truth[v], f"v{v} (reads {path}) differs from the learner's"
    # the last version rebuilt is the model the ranks' own shards hold (the checkpoint's DCP files,
    # each rank's half, read here by one process): not only the bytes rank 0 gathered
    from streamrl.learner.trainer import Trainer
    from streamrl.resume import latest_good

    good = latest_good(tmp_path / "ckpt")
    assert good is not None and good[1].version == len(KINDS) - 1
    shards = Trainer(config(tmp_path / "one", dtype))
    shards.state.load_checkpoint(good[0])
    model = shards.model.state_dict()
    last = dict(iter_safetensors(weights.weights_path(announced[len(KINDS) - 1]["uri"])))
    assert last and all(torch.equal(value, model[name]) for name, value in last.items())
    assert not all(torch.equal(value, model[name]) for name, value in  # (the load changed the weights)
                   iter_safetensors(weights.weights_path(announced[0]["uri"])))
