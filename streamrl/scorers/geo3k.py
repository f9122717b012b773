"""Geometry3K (``hiyouga/geometry3k``), as verl's ``geo3k`` scores it: ``0.9 * accuracy + 0.1 *
format`` (``format_score``), where

- accuracy: the contents of the response's last ``\\boxed{}`` graded against the ground truth by
  mathruler's ``grade_answer`` (PRM800K's grader: normalised strings, then SymPy on the
  difference; a response without a box is graded as the text ``"None"``);
- format: the response is ``<think>...</think>`` followed by a ``\\boxed{...}``.

Both parts are mathruler's and the pattern verl uses, so scores equal verl's. mathruler (and the
pylatexenc it needs) are the ``scorers`` extra, imported on the first call. A ground truth that
is a JSON number reads as its text (mathruler raises on one); null or a non-answer type is the
record's error (``base.ground_truth_text``), where verl scores such a record on format alone. A
comparison SymPy does not finish in ``SYMPY_TIMEOUT_S`` is wrong, where verl's never returns.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from streamrl.scorers.base import ground_truth_text

#: pylatexenc warns on every macro it cannot write as text (``\\frac`` with a missing argument):
#: model output is full of them, and the text is used as it came out either way
logging.getLogger("pylatexenc").setLevel(logging.ERROR)

VERSION = "1"
#: one comparison's budget (verl's prime_math's per comparison): mathruler hands the answer to SymPy,
#: which evaluates what it reads (``9**9**9`` against a non-integer truth never returns, in verl too)
SYMPY_TIMEOUT_S = 10.0
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def _grader() -> tuple[Any, Any]:
    try:
        from mathruler.grader import extract_boxed_content, grade_answer
    except ImportError as exc:  # mathruler itself, or the pylatexenc it imports without declaring it
        raise ImportError(f"the geo3k scorer needs mathruler and pylatexenc: pip install 'streamrl[scorers]' "
                          f"({exc})") from exc
    return extract_boxed_content, grade_answer


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None = None, *, use_boxed: bool = True,
                  format_score: float = 0.1, **kwargs: Any) -> dict[str, Any]:
    """``{"score", "acc", "format", "pred"}``; ``use_boxed=False`` grades the whole response."""
    truth = ground_truth_text(ground_truth, data_source)
    extract, grade = _grader()
    pred = extract(solution_str) if use_boxed else solution_str
    acc = _graded(grade, pred, truth)
    well_formed = _FORMAT.fullmatch(solution_str) is not None
    score = (1.0 - format_score) * float(acc) + format_score * float(well_formed)
    return {"score": score, "acc": acc, "format": well_formed, "pred": pred}


def _graded(grade: Any, pred: str, truth: str) -> bool:
    """mathruler's verdict within ``SYMPY_TIMEOUT_S``: past it, wrong (as prime_math's time limit),
    where verl's call would hold its reward worker for good."""
    from streamrl.errors import Failure
    from streamrl.scorers.math_verify import _bounded, _Deadline

    try:
        return bool(_bounded(lambda: grade(pred, truth), _Deadline(SYMPY_TIMEOUT_S, "comparison")))
    except Failure:
        return False
