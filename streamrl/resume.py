"""The run's resume state: the learner's checkpoints as every stage reads them.

A checkpoint (``<checkpoint_dir>/ckpt-<seq>/``) holds ``state.json`` (``LearnerState``: the
version, the offsets, the de-duplication window, the feed's finished groups, why the learner
stopped) beside the weights (``policy/``) and the optimizer's state. The learner writes them
(``streamrl.learner.checkpoint``); the learner, the feed (which groups not to publish again), the
supervisor (whether a run can resume, and where it ended) and replay read them here, below every
stage, so that none of the readers opens the learner to know where a run stands.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a finished checkpoint's directory name (``ckpt-`` and an eight-digit sequence number); one
#: being written has a hidden name, so it is never read half-written
NAME = re.compile(r"^ckpt-(\d{8})$")
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
    return sorted(p for p in root.iterdir() if p.is_dir() and NAME.match(p.name))


def latest(directory: str | Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def policy_dir(path: str | Path) -> Path:
    """A checkpoint's weights (Hugging Face layout; with LoRA the adapter in PEFT's)."""
    return Path(path) / "policy"


def load_state(path: str | Path) -> LearnerState:
    with open(Path(path) / "state.json") as f:
        data = json.load(f)
    known = LearnerState.__dataclass_fields__
    return LearnerState(**{k: v for k, v in data.items() if k in known})  # an older or newer streamrl's


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
