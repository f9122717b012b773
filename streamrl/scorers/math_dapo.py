"""DAPO's math reward, as verl's ``math_dapo`` shapes it: the answer is the last ``Answer:`` line
of the response's tail, the reward is +1 when it equals the ground truth and -1 otherwise, and
``acc`` says which (DAPO's reward manager logs it).

Where streamrl differs from verl: verl compares the two answers as normalised strings; here the
comparison is streamrl's MATH rule (``math_verify``: the same normalisation of MATH/DAPO ground
truths, then math-verify's equivalence, with its timeouts), so ``0.5`` and ``\\frac{1}{2}`` agree.
"""

from __future__ import annotations

import re
from typing import Any

from streamrl.scorers import math_verify

VERSION = "1"
TAIL_CHARS = 300  # verl's math_dapo looks at the last 300 characters
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``; ``kwargs`` go to the MATH rule
    (timeouts)."""
    found = _ANSWER.findall(solution_str[-TAIL_CHARS:])
    pred = found[-1].strip().rstrip(".") if found else ""
    acc = False
    if pred:
        result = math_verify.compute_score(data_source, f"\\boxed{{{pred}}}", ground_truth, extra_info, **kwargs)
        acc = result["score"] >= 1.0
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
