"""Learner checkpoints: weights, optimizer state, version, consumer offsets and the
de-duplication window, saved together so they always agree.

Layout: ``<checkpoint_dir>/ckpt-<seq>/`` holding ``policy/`` (Hugging Face layout, safetensors:
``load_policy`` reads it), ``optimizer.pt`` (tensors only; read back with
``torch.load(weights_only=True)``, which refuses arbitrary pickled objects) and ``state.json``
(version, offsets, de-dup window, counters). A checkpoint is written into a hidden sibling
directory and renamed into place: a crash mid-write leaves the previous one as the latest.

Why the offsets live here and not only in Kafka: the weights and the offsets must describe the
same moment. On restart the learner seeks to these offsets, so the records consumed after the
checkpoint come back and are trained again (their updates were lost with the process), and
the ones before it do not; records that were finished but sit after the lowest unfinished
offset come back too, and the de-dup window saved alongside skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^ckpt-(\d{8})$")


@dataclass
class LearnerState:
    version: int = 0  # the last finished version
    mini_batches: int = 0  # mini-batches trained towards version + 1
    consumed_records: int = 0  # records taken from the topic (trained or dropped), all time
    trained_records: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # partition (as str) -> next offset
    assembler: dict[str, Any] = field(default_factory=dict)  # de-dup window, closed groups
    created_at: float = field(default_factory=time.time)


def checkpoints(directory: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def latest(directory: str | Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def save(directory: str | Path, model: Any, tokenizer: Any, optimizer_state: dict[str, Any],
         state: LearnerState, keep: int = 2) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``."""
    import torch

    from streamrl.policy import save_policy

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    last = latest(root)
    seq = int(_NAME.match(last.name).group(1)) + 1 if last else 1
    final = root / f"ckpt-{seq:08d}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_policy(model, tokenizer, tmp / "policy")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    state.created_at = time.time()
    with open(tmp / "state.json", "w") as f:
        json.dump(asdict(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: str | Path) -> LearnerState:
    with open(Path(path) / "state.json") as f:
        return LearnerState(**json.load(f))


def load_optimizer_state(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(Path(path) / "optimizer.pt", map_location=device, weights_only=True)


def policy_dir(path: str | Path) -> Path:
    return Path(path) / "policy"
