"""GSM8K: is the final number of a response the reference number?

Two modes behind one function, picked by ``method``:

- ``"robust"`` (the default) finds the answer the way models really write it: ``#### 42``,
  ``\\boxed{42}``, ``The (final) answer is 42``, ``Answer: 42`` / ``A: 42``, else the last number
  in the text; and reads the number through thousands separators (``1,234``), currency signs
  (``$5``, ``€5``), trailing units and periods (``18 dollars.``), negatives (``-3``, ``−3``),
  decimals and simple fractions. Values are compared exactly as rationals, so ``72.0`` equals
  ``72`` and ``0.50`` equals ``1/2``.
- ``"strict"`` / ``"flexible"`` reproduce verl's ``verl.utils.reward_score.gsm8k`` (v0.4+)
  character for character: strict wants ``#### N``, flexible takes the last number, both look at
  the last 300 characters only, and the answer string is compared to the ground truth *as a
  string* (so ``72.0`` is wrong there). Use them to compare rewards with verl runs.

A ground truth may be a JSON number in the robust mode (``42`` reads as ``"42"``); verl's modes
compare strings, so there a ground truth that is not a string is refused
(``base.string_ground_truth``: verl would score every response the same).

``format_score`` is what an extracted but wrong answer earns (verl's meaning); ``score`` what a
right one earns. The result is a dict: ``score`` plus ``pred``, the extracted answer, which lands
in ``reward_info`` so a reader sees why a record scored what it did.

Robust extraction runs inline on the event loop, on text a model wrote, so it is linear in the
response: no pattern can backtrack over a run it already scanned (the old ``(?:^|\\n)\\s*`` made
16k newlines cost 1.5 s), nested or unclosed ``\\boxed{`` are matched in one pass, at most
``_MAX_CANDIDATES`` regions of each kind are read, and a number longer than ``_MAX_NUMBER_CHARS``
is no answer (CPython's ``int(str)`` is quadratic and refuses more than 4300 digits).
"""

from __future__ import annotations

import re
from collections import deque
from fractions import Fraction
from typing import Any

from streamrl.errors import Failure
from streamrl.scorers.base import ground_truth_text, string_ground_truth

VERSION = "1"

# -- robust extraction ----------------------------------------------------------------------------

# A number as written in prose: optional minus (ASCII, Unicode minus, en dash) before or after a
# currency sign, digits with optional comma / thin-space thousands groups, optional decimals,
# optional "/denominator". The look-behind keeps "3-5" from reading as "-5" and "v2.5" as "2.5".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<neg1>[-\u2212\u2013]\s?)?(?:[$\u20ac\u00a3\u00a5\u20b9]\s?)?(?P<neg2>[-\u2212]\s?)?"
    r"(?P<num>(?:\d{1,3}(?:[,\u2009\u202f]\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?(?P<den>\d+)(?![\d.]))?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's own "<<3*4=12>>" annotations
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|was|would\s+be|will\s+be|[:=])\s*:?\s*([^\n]*)",
                        re.IGNORECASE)
# "A: 42" at the start of a line. Anchored with MULTILINE "^" and only horizontal space before
# it: the old "(?:^|\n)\s*" let every newline of a blank run rescan the rest of the run.
_A_COLON = re.compile(r"^[^\S\n]*\**(?:A|Answer)\**\s*:\s*([^\n]*)", re.MULTILINE)
_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")

#: How many regions of one kind (``####``, ``\boxed``, "answer is", "A:") are read, from the last.
#: Nested boxes overlap, so reading all of them would be quadratic; real answers are in the last few.
_MAX_CANDIDATES = 16
#: A longer run of digits is no answer: reading it as an int is quadratic (and refused > 4300 digits).
_MAX_NUMBER_CHARS = 100


def parse_number(text: str) -> Fraction | None:
    """The first number written in ``text`` as an exact rational, or None. After an ``=`` only
    the right-hand side counts ("5 + 3 = 8" reads as 8)."""
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    m = _NUMBER.search(text.replace("\\$", "$").replace("\\%", "%").replace("\\!", "").replace("{,}", ","))
    return _to_fraction(m) if m else None


def _to_fraction(m: re.Match) -> Fraction | None:
    if len(m.group("num")) > _MAX_NUMBER_CHARS or len(m.group("den") or "") > _MAX_NUMBER_CHARS:
        return None
    digits = re.sub(r"[,\u2009\u202f]", "", m.group("num"))
    value = Fraction(digits)
    if m.group("den"):
        den = int(m.group("den"))
        if den == 0:
            return None
        value /= den
    return -value if (m.group("neg1") or m.group("neg2")) else value


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents of every closed ``\\boxed{...}`` / ``\\fbox{...}``, braces
    balanced (``\\boxed{\\text{\\$}18}``), in the order the boxes open. One pass over the braces
    with a stack, so nested or unclosed boxes cost O(len(text)), not a rescan per box; spans, not
    strings, so nested boxes are not copied."""
    spans: list[tuple[int, int]] = []
    stack: list[int] = []  # per open brace: where its box's contents start, or -1 for a plain brace
    for m in _BRACE_TOKENS.finditer(text):
        token = m.group()
        if token == "}":
            if stack:
                start = stack.pop()
                if start >= 0:
                    spans.append((start, m.start()))
        else:
            stack.append(m.end() if token != "{" else -1)
    spans.sort()
    return spans


def boxed_contents(text: str, last: int = _MAX_CANDIDATES) -> list[str]:
    """The contents of the last ``last`` closed boxes, in the order they open."""
    return [text[a:b] for a, b in boxed_spans(text)[-last:]]


def extract_answer(solution_str: str) -> Fraction | None:
    """The response's final answer: the last ``#### N``, else the last ``\\boxed{N}``, else the
    last "the answer is N" / "Answer: N" / "A: N", else the last number anywhere. Linear in the
    response (see the module docstring)."""
    text = _CALCULATOR.sub("", solution_str)
    for candidates in (_last_groups(_HASHES, text), boxed_contents(text),
                       _last_groups(_ANSWER_IS, text), _last_groups(_A_COLON, text)):
        for region in reversed(candidates):
            value = parse_number(region)
            if value is not None:
                return value
    numbers = deque(_NUMBER.finditer(_LATEX_FRAC.sub(r"\1/\2", text)), maxlen=1)
    return _to_fraction(numbers[0]) if numbers else None


def _last_groups(pattern: re.Pattern[str], text: str) -> list[str]:
    """Group 1 of the last ``_MAX_CANDIDATES`` matches, without holding every match: a list of
    100k match strings costs more in allocation and GC than the scan itself."""
    return [m.group(1) for m in deque(pattern.finditer(text), maxlen=_MAX_CANDIDATES)]


def reference_number(ground_truth: str) -> Fraction:
    """The reference as a number: a bare ``42``, ``1,234``, or a whole GSM8K solution ending in
    ``#### 42``. A reference with no number is a data error, not a wrong answer."""
    region = ground_truth.rsplit("####", 1)[1] if "####" in ground_truth else ground_truth
    value = parse_number(region)
    if value is None:
        raise Failure("bad_ground_truth", f"no number in the gsm8k ground truth {ground_truth[:80]!r}")
    return value


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


# -- verl parity ---------------------------------------------------------------------------------

_VERL_CLIP_CHARS = 300


def verl_extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """verl's ``gsm8k.extract_solution``, unchanged in behaviour."""
    assert method in ("strict", "flexible")
    if len(solution_str) > _VERL_CLIP_CHARS:
        solution_str = solution_str[-_VERL_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if len(solutions) == 0:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
    final_answer = None
    if len(answer) == 0:
        return None
    for final_answer in reversed(answer):
        if final_answer not in ("", "."):
            break
    return final_answer


def verl_ground_truth(ground_truth: str) -> str:
    """The ground truth as verl's gsm8k preprocessing writes it: a whole solution is reduced to
    its ``#### N`` number without commas; a bare number is kept as it is."""
    m = re.search("#### (\\-?[0-9\\.\\,]+)", ground_truth)
    return m.group(0).split("#### ")[1].replace(",", "") if m else ground_truth


def verl_compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                       format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's ``gsm8k.compute_score``: ``score`` if the extracted string equals the ground truth,
    ``format_score`` if something was extracted, else 0."""
    answer = verl_extract_solution(solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


# -- the scorer ----------------------------------------------------------------------------------

METHODS = ("robust", "strict", "flexible")


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any] | None = None, *, method: str = "robust",
                  format_score: float = 0.0, score: float = 1.0, **kwargs: Any) -> dict[str, Any]:
    """Score one GSM8K response (streamrl's scorer signature; see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method must be one of {METHODS}, got {method!r}")
    if method != "robust":
        truth = string_ground_truth(ground_truth, data_source, "gsm8k")
        pred = verl_extract_solution(solution_str, method)
        return {"score": float(verl_compute_score(solution_str, verl_ground_truth(truth),
                                                  method, format_score, score)),
                "pred": pred}
    reference = reference_number(ground_truth_text(ground_truth, data_source))
    value = extract_answer(solution_str)
    if value is None:
        return {"score": 0.0, "pred": None}
    return {"score": float(score if value == reference else format_score), "pred": _show(value)}
