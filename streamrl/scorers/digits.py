"""``digits``: the generated digit task's scorer (``streamrl.tasks.digits``), exact with partial
credit.

The response, stripped of surrounding whitespace, must be digits only, else it scores 0
(``pred`` is ``None``): empty, words, signs, spaces inside, non-ASCII digits. A well-formed
response earns ``matches / max(len(response), len(answer))``, ``matches`` counting the positions
where it agrees with the answer: the right answer is 1.0, each wrong or missing digit costs its
share, and so does each extra one. Partial credit gives the policy gradient a signal from the
first version on, where an all-or-nothing reward would be 0 for nearly every early answer.
Whatever the policy wrote, this never raises; a record without a ground truth is the feed's
error and fails as ``no_ground_truth``.
"""

from __future__ import annotations

from typing import Any

from streamrl.scorers.base import ScoreError

VERSION = "1"


def partial_credit(response: str, answer: str) -> float:
    """The share of answer positions ``response`` gets right, over the longer of the two; 0 for
    anything that is not a plain ASCII digit string."""
    text = response.strip() if isinstance(response, str) else ""
    if not (text.isascii() and text.isdigit()) or not answer:
        return 0.0
    matches = sum(a == b for a, b in zip(text, answer))
    return matches / max(len(text), len(answer))


def compute_score(data_source: str, solution_str: Any, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> dict[str, Any]:
    """verl's scorer signature: ``score`` plus ``pred``, the digits read (``None``: malformed)."""
    if ground_truth is None or str(ground_truth) == "":
        raise ScoreError("no_ground_truth", f"data_source {data_source!r}: the record has no answer")
    text = solution_str.strip() if isinstance(solution_str, str) else ""
    well_formed = text.isascii() and text.isdigit()
    return {"score": partial_credit(text, str(ground_truth)), "pred": text[:32] if well_formed else None}
