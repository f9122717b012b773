"""Learner checkpoints: weights, optimizer state, version, consumer offsets and the
de-duplication window, saved together so they always agree.

Layout: ``<checkpoint_dir>/ckpt-<seq>/`` holding ``policy/`` (Hugging Face layout, safetensors:
``load_policy`` reads it; with ``learner.lora`` the adapter in PEFT's layout, the base being
``learner.policy``), ``optimizer.pt`` (tensors only; read back with
``torch.load(weights_only=True)``, which refuses arbitrary pickled objects) and ``state.json``
(version, offsets, de-dup window, counters, lineage). A checkpoint is written into a hidden
sibling directory, every file fsync'd, and renamed into place (the directory fsync'd too): a crash
mid-write leaves the previous one as the latest. The previous ones (``keep``) stay as fallbacks:
``latest_good`` skips a checkpoint that cannot be read. The learner writes ``dcp/`` (model and
optimizer as ``torch.distributed.checkpoint`` shards, one per rank, readable by any number of
ranks: ``Trainer.write_checkpoint``) in place of ``optimizer.pt``, which older checkpoints have.

Why the offsets live here and not only in Kafka: the weights and the offsets must describe the
same moment. On restart the learner seeks to these offsets, so the records consumed after the
checkpoint come back and are trained again (their updates were lost with the process), and
the ones before it do not; records that were finished but sit after the lowest unfinished
offset come back too, and the de-dup window saved alongside skips them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

_NAME = re.compile(r"^ckpt-(\d{8})$")
log = logging.getLogger(__name__)


@dataclass
class LearnerState:
    version: int = 0  # the last finished version
    mini_batches: int = 0  # mini-batches trained towards version + 1
    consumed_records: int = 0  # records taken from the topic (trained or dropped), all time
    trained_records: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # partition (as str) -> next offset
    assembler: dict[str, Any] = field(default_factory=dict)  # de-dup window, closed groups
    lineage: str = ""  # this training line (streamrl.records.PolicyVersion.lineage)
    abandoned: dict[str, int] = field(default_factory=dict)  # earlier line -> last version kept
    # group ids of the feed finished for good (trained, dropped, or lost upstream): a resumed
    # feed does not publish them again, and the end of the data is counted from them
    done_groups: list[str] = field(default_factory=list)
    ended: str = ""  # why the learner stopped: versions | data_exhausted ("" while running)
    # the figures ``version`` is announced with: a learner killed between its checkpoint and the
    # announcement announces them on restart, so no tracker misses that version
    summary: dict[str, float] = field(default_factory=dict)
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


def latest_good(directory: str | Path) -> tuple[Path, LearnerState] | None:
    """The newest checkpoint that reads back whole (state and weights present), newest first;
    a damaged one is skipped with a warning."""
    for path in reversed(checkpoints(directory)):
        try:
            state = load_state(path)
            has_policy = any((policy_dir(path) / f).is_file() for f in ("config.json", "adapter_config.json"))
            if not has_policy or not (
                    (path / "optimizer.pt").is_file() or (path / "dcp" / ".metadata").is_file()):
                raise FileNotFoundError("policy/config.json (adapter_config.json with LoRA) or optimizer.pt / "
                                        "dcp/.metadata missing")
            return path, state
        except (OSError, ValueError, TypeError) as exc:
            log.warning("checkpoint %s is unreadable (%s): falling back to an older one", path, exc)
    return None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, model: Any, tokenizer: Any, optimizer_state: dict[str, Any] | None,
         state: LearnerState, keep: int = 2, write: Callable[[Path], None] | None = None) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``. ``write``: writes
    the weights and optimizer into the directory instead (``Trainer.write_checkpoint``: ``policy/``
    and the ranks' ``torch.distributed.checkpoint`` shards in ``dcp/``)."""
    import torch

    from streamrl.weights import save_policy

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    last = latest(root)
    seq = int(_NAME.match(last.name).group(1)) + 1 if last else 1
    final = root / f"ckpt-{seq:08d}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if write is not None:
        write(tmp)
    else:
        save_policy(model, tokenizer, tmp / "policy")
        torch.save(optimizer_state, tmp / "optimizer.pt")
    state.created_at = time.time()
    with open(tmp / "state.json", "w") as f:
        json.dump(asdict(state), f)
    _fsync_tree(tmp)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: str | Path) -> LearnerState:
    with open(Path(path) / "state.json") as f:
        data = json.load(f)
    known = LearnerState.__dataclass_fields__
    return LearnerState(**{k: v for k, v in data.items() if k in known})  # an older or newer streamrl's


def load_optimizer_state(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(Path(path) / "optimizer.pt", map_location=device, weights_only=True)


def policy_dir(path: str | Path) -> Path:
    return Path(path) / "policy"
