"""The one check of a reward's value, wherever a reward is made or used (a scorer's score, the
score plus the turn reward, the learner's input): finite in fp32 (the width it is computed
and trained in) and within the configured bound. A reward that fails it is a per-record
failure with the same reason at every stage."""

from __future__ import annotations

import math

import numpy as np

from streamrl.errors import Failure


def check_reward(value: float, limit: float, field: str, what: str = "",
                 error: type[Failure] = Failure) -> None:
    """Raise ``error("non_finite_reward" | "reward_out_of_range", detail)`` unless ``value`` is
    finite in fp32 and ``|value| <= limit``; ``field`` names the bound's config field, ``what``
    the value in the detail (default ``reward <value>``)."""
    shown = what or f"reward {value!r}"
    with np.errstate(over="ignore"):  # beyond fp32's range is exactly the infinity refused here
        wide = np.float32(value)
    if not math.isfinite(wide):
        raise error("non_finite_reward", f"{shown} is not finite in fp32")
    if abs(wide) > limit:
        raise error("reward_out_of_range", f"{shown} is beyond {field} ({limit})")
