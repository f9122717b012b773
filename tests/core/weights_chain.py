"""A chain of versions the learner's own trainer writes and publishes by delta (full, deltas, full),
with the full files kept aside to compare with: what the delta tests and the damaged-store tests
(``test_weights_delta``, ``test_weights_damage``) start from."""

from __future__ import annotations

import shutil
from pathlib import Path

from streamrl.weights import delta
from tests.helpers import batch, learner_cfg

VERSIONS = 7  # full_every 4: v1 full, v2-v4 deltas, v5 full, v6-v7 deltas
KINDS = {1: "full", 2: "delta", 3: "delta", 4: "delta", 5: "full", 6: "delta", 7: "delta"}


def train_chain(root: Path, dtype: str, lr: float = 1e-3) -> tuple[Path, Path]:
    """The learner's trainer for VERSIONS steps on the tests' batches, each version written by
    ``save_weights`` and published by a ``DeltaWriter``; a copy of each full version's files is
    kept aside (``full/v<N>``) to compare with. Returns (the published versions, the full copies)."""
    from streamrl.learner.trainer import Trainer

    trainer = Trainer(learner_cfg(root, dtype=dtype, lr=lr))
    writer = delta.DeltaWriter(full_every=4)
    published, full = root / "weights", root / "full"
    for v in range(1, VERSIONS + 1):
        trainer.step(batch(v))
        path = trainer.save_weights(published / f"v{v}")
        shutil.copytree(path, full / f"v{v}")
        out = writer.publish(path, v)
        assert out.kind == KINDS[v], (v, out)
        if out.kind == "delta":
            assert out.base_version == v - 1 and out.full_version == (1 if v < 5 else 5)
            assert out.weight_bytes < out.full_bytes
            assert not list(path.glob("*.safetensors"))  # only the delta goes out
    return published, full


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in b.glob("*.safetensors"))
    assert names and sorted(p.name for p in a.glob("*.safetensors")) == names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "config.json").is_file()
    if a.parent.name != "weights":  # rebuilt or exported: a full directory, no delta manifest in it
        assert not (a / delta.MANIFEST).exists()
