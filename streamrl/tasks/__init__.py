"""Tasks the project generates in code: seeded, verifiable, no file and no network.

A task is a dataset name (``feed.dataset: digits``) that ``streamrl.datasets`` resolves here,
with a rule scorer of the same name (``streamrl.scorers.digits``). They exist so the embedded
default (``streamrl run``) trains on something the tiny CPU policy can learn in minutes, which
GSM8K is not, and so that run needs no file and no network.
"""

from __future__ import annotations

from typing import Any

from streamrl.errors import ConfigError
from streamrl.tasks import digits

#: dataset name -> the module that generates it (``generate(spec, limit)``, ``warm_start(dir, ...)``)
TASKS = {digits.NAME: digits}


def task_name(spec: str) -> str:
    return spec.partition("@")[0].partition(":")[0]


def is_task(spec: str) -> bool:
    """Whether ``spec`` names a generated task (``digits``, ``digits:rev``, ``digits@3``)."""
    return task_name(spec) in TASKS


def task_rows(spec: str, limit: int = 0) -> list[dict[str, Any]]:
    """The rows of the generated task ``spec`` (``limit`` 0: its default size). A malformed spec
    raises ``ConfigError`` naming ``feed.dataset``."""
    try:
        return TASKS[task_name(spec)].generate(spec, limit)
    except ValueError as exc:
        raise ConfigError(f"config field 'feed.dataset': {exc}") from None


__all__ = ["TASKS", "is_task", "task_rows"]
