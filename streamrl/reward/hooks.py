"""Built-in group hooks: functions over one complete group (all samples of one prompt).

A hook receives the group's members, in the order they were scored, as plain dicts
(``id``, ``reward``, ``reward_info``, ``response``, ``ground_truth``, ``data_source``,
``extra_info``) plus the configured ``kwargs``, and returns one new reward per member: a number,
or a dict with ``score`` and extra fields (they land in ``reward_info["group"]``). It may be
sync or async. A user hook is named like a user scorer: ``file.py:name`` or ``module:name``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def normalize(members: list[dict[str, Any]], eps: float = 1e-6,
              scale: bool = True) -> list[float]:
    """GRPO's group-relative advantage as the reward: ``(r - mean) / (std + eps)`` (``scale``
    false: ``r - mean``), computed in fp32 like the learner would."""
    r = np.asarray([m["reward"] for m in members], dtype=np.float32)
    out = r - r.mean()
    if scale and len(r) > 1:
        out = out / (r.std(ddof=1) + np.float32(eps))
    return [float(x) for x in out]


def majority_vote(members: list[dict[str, Any]], key: str = "pred") -> list[dict[str, Any]]:
    """Self-consistency without labels (TTRL): 1 for members whose extracted answer
    (``reward_info[key]``, e.g. the gsm8k scorer's ``pred``) is the group's most common one,
    else 0. Members with no answer get 0."""
    answers = [m["reward_info"].get(key) for m in members]
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return [{"score": 0.0, "majority": None} for _ in members]
    winner, _ = counts.most_common(1)[0]
    return [{"score": 1.0 if a == winner else 0.0, "majority": winner} for a in answers]


HOOKS = {"normalize": normalize, "majority_vote": majority_vote}
