"""streamrl's error tree, a leaf module (it imports nothing of streamrl).

Two roots, never mixed:

- ``StreamrlError``: an error the user can act on. The CLI prints its message on one line, with
  no traceback, and exits 2. The message names what to change: the config field, the
  command-line override, the address, the missing extra.
- ``RecordOutcome``: what happened to one record when it could not become its output:
  ``Failure`` (permanent: a dead letter with a reason) or ``Unavailable`` (transient: hold and
  retry). Stages handle these per record; they are not user errors, so one that ever escaped to
  the CLI is a bug with its traceback, never an exit 2 that blames the user's config. Scorer
  authors know them as ``streamrl.scorers.ScoreError`` / ``ScorerUnavailable`` (the same classes).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class StreamrlError(Exception):
    """An error the user can act on; its message is one line that says what to change."""


class ConfigError(StreamrlError, ValueError):
    """A bad config: the message names the field, and where the value came from."""


class StorageFull(StreamrlError, OSError):
    """A write found its storage full: no space left on the device, a quota, a file-size limit.
    A restart cannot fix it, so the stage stops (exit 2) and the run with it, naming the path;
    what was not written stays unfinished (not committed) and is done again on ``--resume``."""


#: what a full device, a quota or a file-size limit reads as, in the OS error's errno or in the
#: message of a library that wraps it (safetensors' Rust "os error 28")
_FULL_ERRNOS = (28, 122, 27)  # ENOSPC, EDQUOT, EFBIG (Linux)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "File too large",
               "os error 28", "os error 122", "os error 27")


def storage_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, is a full storage (``StorageFull``'s)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if any(w in str(exc) for w in _FULL_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class MissingExtra(StreamrlError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def need(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency, or fail in one line naming the extra that installs it:
    ``streamrl run needs torch: pip install 'streamrl[cpu]'``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {module.split('.')[0]}: pip install 'streamrl[{extra}]'") from None


class RecordOutcome(Exception):
    """The root of per-record outcomes, apart from the user errors: ``reason`` is short and
    stable (a metric label and the dead-letter reason), ``detail`` says exactly what happened."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Failure(RecordOutcome):
    """Permanent, for this one record: it cannot be decoded, scored or used. Every stage sends
    it to the dead-letter topic with its original bytes and the reason, and goes on with the
    next record (after the bounded retries the stage allows)."""


class Unavailable(RecordOutcome):
    """Transient: a backend (judge, reward server, generation server, broker) cannot serve now.
    Every stage holds the record, backs off and retries; never a dead letter, never a made-up
    score."""
