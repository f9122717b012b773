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


def ground_truth_text(ground_truth: Any, data_source: str) -> str:
    """A record's ground truth as the text a rule compares with: a string as it is, a JSON number
    as its decimal text (parquet files carry integer answers: ``17`` reads as ``"17"``, ``2.0``
    as ``"2"``, ``0.5`` as ``"0.5"``). Anything else cannot be an answer to compare with and is
    the record's error, never a traceback or a made-up 0: ``None`` is ``no_ground_truth``; a
    bool, list, object or a non-finite number is ``bad_ground_truth``."""
    if isinstance(ground_truth, str):
        return ground_truth
    if ground_truth is None:
        raise ScoreError("no_ground_truth", f"data_source {data_source!r}: the record has no ground_truth")
    try:
        if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
            return str(ground_truth)
        if isinstance(ground_truth, float) and math.isfinite(ground_truth):
            return str(int(ground_truth)) if ground_truth.is_integer() else repr(ground_truth)
    except ValueError:  # an integer beyond CPython's 4300-digit limit on str()
        pass
    raise ScoreError("bad_ground_truth", f"data_source {data_source!r}: a ground_truth of type "
                                         f"{type(ground_truth).__name__} is not an answer ({_show(ground_truth)})")


def _show(value: Any) -> str:
    """A value's first characters for a message; never raises."""
    try:
        return repr(value)[:80]
    except Exception:  # noqa: BLE001 - a huge int, a repr that fails
        return f"<{type(value).__name__}>"


def string_ground_truth(ground_truth: Any, data_source: str, scorer: str) -> str:
    """verl's mode for the rules that compare the answer with the ground truth *as strings*
    (verl's ``gsm8k``, ``math_reward``): only a string can ever equal an answer there, so verl
    scores every response the same (0, or the format score) when the ground truth is a number,
    a list or null, whatever was written. Such a record is refused with that reason (dead letters)
    rather than trained on a constant reward."""
    if isinstance(ground_truth, str):
        return ground_truth
    if ground_truth is None:
        raise ScoreError("no_ground_truth", f"data_source {data_source!r}: the record has no ground_truth")
    raise ScoreError("bad_ground_truth", f"data_source {data_source!r}: verl's {scorer} compares the answer with "
                                         f"the ground truth as strings, and a {type(ground_truth).__name__} "
                                         f"({_show(ground_truth)}) never equals one: verl would score every "
                                         f"response the same; store the ground truth as a string")
