"""What every scorer shares: the errors that tell the reward stage what to do with a failure.

A scorer is any callable with verl's signature (docs/contracts.md), sync or async::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

A dict result carries ``"score"`` plus extra fields, which land in ``reward_info``. Built-in rule
scorers, user functions, the LLM judge and the reward model all present that one signature.
"""

from __future__ import annotations

import math
from typing import Any

from streamrl.errors import Failure, Unavailable


#: This record cannot be scored (e.g. the judge's answer has no score). The reward stage
#: retries a bounded number of times, then sends the record to dead letters with the reason.
#: The name scorer authors write (``from streamrl.scorers import ScoreError``): the same class as
#: ``streamrl.errors.Failure``, which the package itself uses.
ScoreError = Failure

#: The scorer's backend is down (every judge / reward server failing). The reward stage holds
#: the record and tries again later (back-pressure): an outage is never scored 0.
#: The same class as ``streamrl.errors.Unavailable``.
ScorerUnavailable = Unavailable


def split_result(result: Any, name: str = "scorer") -> tuple[float, dict[str, Any]]:
    """A scorer's result as ``(score, extras)``, in every shape verl accepts: a number or bool, a
    dict with ``score`` and extra fields, or a tuple / list ``(score, ...)`` (verl takes
    ``res[0]``; the reward agent's functions return ``(score, query, response)``: the extra items
    are kept as ``extras["extra"]``). Anything else is the scorer's error, not a reward."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ScoreError("bad_score", f"{name} returned a dict without 'score': {sorted(result)[:10]}")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    else:
        extras = {}
    if isinstance(result, (list, tuple)) and result:
        if len(result) > 1:
            extras["extra"] = list(result[1:])
        result = result[0]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ScoreError("bad_score", f"{name} returned {type(result).__name__}, not a number") from None
    return score, extras


#: ``reward_info`` keys the reward stage itself writes: not a scorer's extra fields
STAGE_INFO = frozenset({"status", "attempts", "error"})


def numeric_info(info: dict[str, Any]) -> dict[str, float]:
    """A ``reward_info``'s numeric extra fields (bools as 0/1, finite numbers only): what verl
    logs per data source (``acc``, ``overlong``, ...), exported as ``streamrl_reward_info`` and
    averaged per data source in ``streamrl run``'s summary."""
    out = {}
    for key, value in info.items():
        if key not in STAGE_INFO and isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out
