"""DAPO's math reward, shaped as verl's ``math_dapo`` shapes it: ``{"score": +1 | -1, "acc",
"pred"}`` (DAPO's reward manager logs ``acc``).

Reading the answer, in both modes, as verl reads it. Only the response's last 300 characters
count. The answer is the last ``Answer: ...`` line there (Minerva's form), normalised the way
DAPO normalises final answers (``normalize``: the right-hand side of an ``=``, words and units
such as ``dollars`` / ``\\text{cm}`` / degrees dropped, ``$...$`` / ``\\text{}`` / ``\\boxed{}``
unwrapped, ``\\frac12`` -> ``\\frac{1}{2}``, thousands commas of a plain integer dropped). When
there is no such line, the last ``\\boxed{...}`` of the last 100 characters is the answer, as it
is written. ``pred`` is what was read: the normalised line, the box's contents, or
``"[INVALID]"`` when there is neither.

Comparing, by ``method``:

- ``"verl"`` (verl's mode: ``reward.verl_compat``, a verl launch script) gives verl 0.9.1's
  verdict: the normalised line equals the normalised ground truth as strings; a box equals the
  ground truth unnormalised.
- ``"math_verify"`` (streamrl's default) accepts what verl accepts and, where verl's strings
  differ, asks streamrl's MATH rule (``math_verify``: math-verify's equivalence, with its
  timeouts), so ``0.5`` and ``\\frac{1}{2}`` agree. It never rejects what verl accepts; a ground
  truth math-verify cannot read keeps verl's verdict instead of failing the record.

A ground truth that is a JSON number reads as its text in both modes (verl raises on one); one
that cannot be an answer (null, bool, list, object) is the record's error (``base.ground_truth_text``).
"""

from __future__ import annotations

import re
from typing import Any

from streamrl.errors import Failure
from streamrl.scorers import math_verify
from streamrl.scorers.base import ground_truth_text

VERSION = "2"  # 2: the \boxed{} fallback, verl's normalised pred, method verl | math_verify
METHODS = ("math_verify", "verl")
TAIL_CHARS = 300  # DAPO reads the response's last 300 characters
BOX_TAIL_CHARS = 100  # ... and looks for the fallback box in the last 100 of those
INVALID = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# -- DAPO's normalisation of a final answer ------------------------------------------------------
# Applied in this order: plain replacements, then words and marks dropped, then the regex
# rewrites. The tables are DAPO's (the Minerva paper's normalisation, as verl ships it).
_REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
_REWRITES = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), "$\\2$"),  # the first $...$ of each line is all that stays
    (re.compile(r"\\text\{(.*?)\}"), "\\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), "\\1"),
    (re.compile(r"\\overline\{(.*?)\}"), "\\1"),
    (re.compile(r"\\boxed\{(.*)\}"), "\\1"),
    (re.compile(r"frac([^{])(.)"), "frac{\\1}{\\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), "sqrt{\\1}"),  # \sqrt2 -> \sqrt{2}
)


def normalize(answer: str) -> str:
    """A final answer as DAPO compares it (see the module docstring)."""
    text = answer.rsplit("=", 1)[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for mark in _DROPPED:
        text = text.replace(mark, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_box(text: str) -> str | None:
    """The contents of the last ``\\boxed{`` in ``text``, braces balanced; None when there is
    none or it is never closed (an earlier box does not count then, as in verl)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{"):i]
    return None


def read_answer(solution_str: str) -> tuple[str, bool]:
    """``(pred, boxed)``: the answer DAPO reads from a response, and whether it came from the
    fallback box (compared unnormalised) rather than an ``Answer:`` line."""
    tail = solution_str[-TAIL_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    pred = normalize(lines[-1] if lines else INVALID)
    if pred != INVALID:
        return pred, False
    box = last_box(tail[-BOX_TAIL_CHARS:])
    return (box, True) if box is not None else (pred, False)


def verl_verdict(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """verl 0.9.1's ``math_dapo`` verdict and ``pred`` (``strict_box_verify`` off)."""
    pred, boxed = read_answer(solution_str)
    return (pred == ground_truth if boxed else pred == normalize(ground_truth)), pred


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None = None, *, method: str = "math_verify",
                  **kwargs: Any) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``; ``kwargs`` go to the MATH rule
    (its timeouts) in the ``math_verify`` method."""
    if method not in METHODS:
        raise ValueError(f"math_dapo method must be one of {METHODS}, got {method!r}")
    truth = ground_truth_text(ground_truth, data_source)
    acc, pred = verl_verdict(solution_str, truth)
    if not acc and method == "math_verify":
        acc = _math_verify_equal(data_source, solution_str, truth, extra_info, **kwargs)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _math_verify_equal(data_source: str, solution_str: str, truth: str, extra_info: Any, **kwargs: Any) -> bool:
    """The MATH rule on the answer as written: the ``Answer:`` line verl read, or the fallback box."""
    pred, boxed = read_answer(solution_str)
    lines = _ANSWER_LINE.findall(solution_str[-TAIL_CHARS:])
    written = pred if boxed else lines[-1].strip().rstrip(".") if lines else ""
    if not written:
        return False
    try:
        result = math_verify.compute_score(data_source, f"\\boxed{{{written}}}", truth, extra_info, **kwargs)
    except Failure as exc:
        if exc.reason == "bad_ground_truth":  # math-verify cannot read it: verl's verdict stands
            return False
        raise
    return result["score"] >= 1.0
