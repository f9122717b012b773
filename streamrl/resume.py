"""The run's resume state: the learner's checkpoints as every stage reads them.

A checkpoint (``<checkpoint_dir>/ckpt-<seq>/``) holds ``state.json`` (``LearnerState``: the
version, the offsets, the de-duplication window, the feed's finished groups, why the learner
stopped) beside the weights (``policy/``) and the optimizer's state. The learner writes them
(``streamrl.learner.checkpoint``); the learner, the feed (which groups not to publish again), the
supervisor (whether a run can resume, and where it ended) and replay read them here, below every
stage, so that none of the readers opens the learner to know where a run stands.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from streamrl.errors import StreamrlError

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
    # the feed's groups finished for good (trained, dropped, or lost upstream): a resumed feed
    # does not publish them again, and the end of the data is counted from them (``finished``).
    # Those at a known position of the feed's order are bits of ``done_bits`` (one bit a group,
    # zlib and base64: ~2 bytes per version where the ids took ~580, issue 68), checked against
    # ``done_order`` ([positions covered, their ids' digest]); ``done_groups``: the rest, by id
    done_groups: list[str] = field(default_factory=list)
    done_bits: str = ""
    done_order: list = field(default_factory=list)
    ended: str = ""  # why the learner stopped: versions | data_exhausted ("" while running)
    # the figures ``version`` is announced with: a learner killed between its checkpoint and the
    # announcement announces them on restart, so no tracker misses that version
    summary: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)


class FeedChanged(StreamrlError):
    """The finished groups of a checkpoint were recorded against another feed's order."""


def order_digest(order: Sequence[str]) -> str:
    """What ``done_order`` checks a feed's order by (its ids, in order)."""
    h = hashlib.sha256()
    for gid in order:
        h.update(gid.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


def pack_finished(state: LearnerState, done: Iterable[str], order: Sequence[str] | None) -> None:
    """Record the finished groups ``done`` in ``state``: by position in the feed's ``order``
    where it holds them, by id the rest. Without an order (the learner did not read the feed)
    the bits an earlier session recorded stay as they are and ``done`` is kept by id."""
    done = set(done)
    if order is None:
        state.done_groups = sorted(done)
        return
    bits = bytearray((len(order) + 7) // 8)
    for i, gid in enumerate(order):
        if gid in done:
            bits[i >> 3] |= 1 << (i & 7)
            done.discard(gid)
    state.done_bits = base64.b64encode(zlib.compress(bytes(bits), 9)).decode()
    state.done_order = [len(order), order_digest(order)]
    state.done_groups = sorted(done)


def finished(state: LearnerState, order: Sequence[str] | None) -> set[str]:
    """Every finished group id of ``state`` (``pack_finished``), the positions read against the
    feed's ``order``; ``FeedChanged`` if the state has positions and ``order`` is not (or does
    not begin with) the order they were recorded in: a resumed run must feed the same data
    (more epochs after it are fine), or its finished prompts could be fed again unseen."""
    out = set(state.done_groups)
    if not state.done_bits:
        return out
    n, digest = state.done_order
    if order is None or len(order) < n or order_digest(order[:n]) != digest:
        raise FeedChanged(f"the checkpoint's {finished_count(state)} finished prompt groups were recorded against "
                          "another feed (feed.dataset, limit, seed, shuffle, epochs or the data changed): resume "
                          "with the feed the run was started with")
    out.update(order[i] for i in finished_positions(state))
    return out


def _bits(state: LearnerState) -> bytes:
    return zlib.decompress(base64.b64decode(state.done_bits)) if state.done_bits else b""


def finished_positions(state: LearnerState) -> set[int]:
    """The positions in the feed's order ``state`` records as finished (its bits)."""
    bits = _bits(state)
    return {i for i in range(len(bits) * 8) if bits[i >> 3] >> (i & 7) & 1}


def finished_count(state: LearnerState) -> int:
    """How many groups ``state`` records as finished (no feed needed)."""
    return sum(byte.bit_count() for byte in _bits(state)) + len(state.done_groups)


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
