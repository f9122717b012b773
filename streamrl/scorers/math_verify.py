"""Math: is the response's final answer equivalent to the reference?

Equivalence is Hugging Face's ``math-verify`` (LaTeX and plain expressions parsed to SymPy, then
compared symbolically and numerically: ``\\frac{1}{2}`` = ``0.5``, ``x=3`` = ``3``, intervals,
sets, matrices), not a hand-written comparator. Before it compares, both sides are normalised the
way MATH and DAPO write answers (what verl's ``math_dapo.normalize_final_answer`` and the MATH
``strip_string`` handle): escaped dollars (``\\$10``), ``\\text{...}`` units (``5\\text{ cm}``)
and choices (``\\text{(A)}``), degrees (``30^\\circ``), ``\\dfrac`` / ``\\tfrac``, ``\\left`` /
``\\right``, thin spaces (``\\!``, ``\\,``) and thousands separators (``1{,}000``). Without that,
``\\$10`` as a ground truth does not parse at all and the record is dead-lettered. Unlike those
normalisers, a unit is not silently dropped when both sides name a known one: ``5\\text{ m}`` is
not ``5\\text{ cm}``.

The response's answer is the last ``\\boxed{...}`` (found in one linear pass), else whatever
math-verify's own extraction finds in the last ``max_response_chars`` characters.

Bounded time. SymPy can run away on adversarial input (``[2^{\\frac{1}{2^{1000}}}, \\infty)``
against ``[1, +\\infty)`` grew to 4 GB in 30 s), so parsing and comparing each have a budget
(``parse_timeout_s``, ``verify_timeout_s``; scorer kwargs). In a main thread, as in the reward
stage's worker processes (pebble runs the task on the forked worker's main thread) and in
``default_compute_score``, math-verify's own ``signal.alarm`` timeouts enforce it; a timer the
caller had armed is put back afterwards. Signals cannot be used off the main thread (the
``thread`` executor), so there a trace function ends the work at the deadline instead (it fires
on Python calls, which is where SymPy spends its time). Running out of budget is
``ScoreError("timeout")``, which the stage retries, then dead-letters or maps to a configured
fallback; never a silent 0.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import threading
import time
from itertools import product
from types import FrameType
from typing import Any, Callable, TypeVar

from streamrl.scorers.base import ScoreError
from streamrl.scorers.gsm8k import boxed_spans

VERSION = "2"  # 2: ground truths normalised (\$, units, degrees, ...); timeouts are scorer failures

#: Budgets for math-verify's parsing (ground truth and response together) and comparing, seconds.
PARSE_TIMEOUT_S = 5.0
VERIFY_TIMEOUT_S = 5.0
#: Only the tail of a response is read: final answers are at the end, and math-verify's
#: extraction and parsing cost grows with the text it is given.
MAX_RESPONSE_CHARS = 20_000

T = TypeVar("T")

# -- normalisation --------------------------------------------------------------------------------

# Known units, by canonical name. A unit outside this table is still removed before comparing,
# it just cannot make an answer wrong.
_UNIT_NAMES = {
    "mm": ("mm", "millimeter", "millimetre"), "cm": ("cm", "centimeter", "centimetre"),
    "m": ("m", "meter", "metre"), "km": ("km", "kilometer", "kilometre"),
    "in": ("in", "inch", "inches"), "ft": ("ft", "foot", "feet"), "yd": ("yd", "yard"),
    "mi": ("mi", "mile"), "s": ("s", "sec", "second"), "min": ("min", "minute"),
    "h": ("h", "hr", "hour"), "day": ("day",), "week": ("week", "wk"), "year": ("year", "yr"),
    "g": ("g", "gm", "gram"), "kg": ("kg", "kilogram"), "lb": ("lb", "lbs", "pound"),
    "oz": ("oz", "ounce"), "ml": ("ml", "milliliter", "millilitre"), "l": ("l", "liter", "litre"),
    "dollar": ("dollar",), "cent": ("cent", "\u00a2"), "degree": ("degree", "deg"),
    "mph": ("mph",), "unit": ("unit",),
}
_UNIT_CANON = {alias: canon for canon, aliases in _UNIT_NAMES.items() for alias in aliases}

_TEXT_CMD = r"\\(?:text|textnormal|textrm|mbox|mathrm)\s*"
# A trailing unit after a value: "5\text{ cm}", "5 \mbox{cm}^2", "12 inches", "3 square feet".
_TRAILING_UNIT = re.compile(
    r"^(?P<head>.*?\S)\s*(?:\\(?P<cmd>text|textnormal|textrm|mbox|mathrm)\s*\{(?P<text>[^{}]*)\}"
    r"|\s(?P<word>(?:square\s+|sq\.?\s+|cubic\s+)?[A-Za-z]+\.?))\s*(?P<exp>\^\s*\{?\s*[23]\s*\}?)?\s*$",
    re.DOTALL)
_CHOICE = re.compile(r"^(?:" + _TEXT_CMD + r"|\\textbf\s*)?\{?\s*\(\s*([A-Z])\s*\)\s*\}?$")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\degree|\u00b0")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?:\s*\.|(?![A-Za-z]))")
_THIN_SPACES = re.compile(r"(?<!\\)\\[!,;:](?![A-Za-z])|[\u2009\u202f]")
_SPACES = re.compile(r"(?<!\\)\\ |~")  # "\ " and "~" are spaces; "\\ " is a line break
_BRACED_COMMA = re.compile(r"(?<=\d)\{,\}(?=\d)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DISPLAY_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DISPLAY_BINOM = re.compile(r"\\[dt]binom(?![A-Za-z])")


def normalize_latex(text: str) -> str:
    """Rewrites that are safe anywhere in a response: escaped dollars, display-style fractions,
    ``\\left`` / ``\\right``, degree marks, thin and control spaces, braced thousands commas,
    Unicode minus."""
    text = text.replace("\\$", "").replace("\u2212", "-").replace("\\displaystyle", "")
    text = _DISPLAY_FRAC.sub(r"\\frac", text)
    text = _DISPLAY_BINOM.sub(r"\\binom", text)
    text = _LEFT_RIGHT.sub("", text)
    text = _DEGREES.sub("", text)
    text = _THIN_SPACES.sub("", text)
    text = _SPACES.sub(" ", text)
    return _BRACED_COMMA.sub("", text)


def canonical_unit(unit: str) -> str | None:
    """``"centimeters"`` -> ``"cm"``, ``"square feet"`` / ``"ft^2"`` -> ``"ft^2"``; None for a
    unit not in the table."""
    unit = unit.strip().lower().replace(" ", "")
    power = ""
    for prefix, p in (("square", "^2"), ("sq.", "^2"), ("sq", "^2"), ("cubic", "^3")):
        if unit.startswith(prefix) and len(unit) > len(prefix):
            unit, power = unit[len(prefix):], p
            break
    m = re.search(r"\^\{?([23])\}?$", unit)
    if m:
        unit, power = unit[:m.start()], "^" + m.group(1)
    unit = unit.rstrip(".")
    for candidate in (unit, unit[:-2] if unit.endswith("es") else None, unit[:-1] if unit.endswith("s") else None):
        if candidate and candidate in _UNIT_CANON:
            return _UNIT_CANON[candidate] + power
    return None


def normalize_answer(answer: str) -> tuple[str, str | None]:
    """An answer (a ground truth, or the contents of a response's box) as ``(value, unit)``: math
    delimiters and MATH/DAPO notation normalised, a trailing unit split off (``unit`` is its
    canonical name, or None when there is no known one), ``\\text{(A)}`` reduced to ``A``, and
    thousands separators dropped from a plain number."""
    text = answer.strip().replace("\\$", "")
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right):
            text = text[len(left):-len(right)].strip()
    text = normalize_latex(text)
    choice = _CHOICE.match(text)
    if choice:
        return choice.group(1), None
    unit = None
    m = _TRAILING_UNIT.match(text)
    if m and re.search(r"\d", m.group("head")):
        raw = m.group("text") if m.group("text") is not None else m.group("word")
        canon = canonical_unit(raw + (m.group("exp") or "").replace(" ", ""))
        # \text{...} is always a unit; a bare word or \mathrm{...} only if it is a known one
        # ("2 x" is not 2, and "2\mathrm{e}" / "3\mathrm{i}" are numbers, not 2 and 3)
        if canon is not None or m.group("cmd") in ("text", "textnormal", "textrm", "mbox"):
            text, unit = m.group("head").strip(), canon
    text = text.strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    return text, unit


def ground_truth_answer(ground_truth: str) -> str:
    """The answer part of a ground truth: the last box of a whole solution, else all of it."""
    spans = boxed_spans(ground_truth)
    if spans:
        a, b = spans[-1]
        return ground_truth[a:b]
    return ground_truth


# -- bounded math-verify --------------------------------------------------------------------------

class _Deadline:
    """One phase's budget. ``seconds <= 0`` means no budget (math-verify's own convention)."""

    def __init__(self, seconds: float, phase: str):
        self.seconds, self.phase = float(seconds), phase
        self.end = time.monotonic() + self.seconds if self.seconds > 0 else math.inf
        # signal.alarm works only on the main thread of the main interpreter
        self.signals = threading.current_thread() is threading.main_thread()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> ScoreError:
        return ScoreError("timeout", f"math-verify {self.phase} ran over {self.seconds:g} s")


class _TraceDeadline:
    """A per-thread trace function that raises math-verify's ``TimeoutException`` (a
    ``BaseException``, so SymPy's ``except Exception`` does not swallow it) at the first Python
    call after the deadline: the off-main-thread stand-in for ``signal.alarm``. It chains to a
    tracer already installed (a debugger, coverage) and puts it back afterwards."""

    def __init__(self, end: float, exc: type[BaseException]):
        self.end, self.exc, self.fired = end, exc, False
        self.previous: Callable[..., Any] | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > self.end:
            self.fired = True
            raise self.exc("streamrl: math-verify deadline")
        return self.previous(frame, event, arg) if self.previous is not None else None

    def __enter__(self) -> "_TraceDeadline":
        self.previous = sys.gettrace()
        sys.settrace(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        sys.settrace(self.previous)


def _bounded(call: Callable[[int | None], T], deadline: _Deadline) -> T:
    """``call(timeout)`` within ``deadline``: ``timeout`` is what to pass to math-verify (whole
    seconds for its ``signal.alarm``, or None off the main thread, where a trace function keeps
    the deadline instead). Running out is ``ScoreError("timeout")``."""
    from math_verify.errors import TimeoutException

    left = deadline.remaining()
    if left <= 0:
        raise deadline.expired()
    try:
        if math.isinf(left):
            return call(None)
        if deadline.signals:
            outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
            started = time.monotonic()
            try:
                return call(max(1, math.ceil(left)))
            finally:
                # math-verify cancels the alarm with alarm(0) and restores the old handler; a
                # timer the caller had armed (pytest-timeout, a supervisor) is re-armed here
                if outer_delay > 0:
                    spent = time.monotonic() - started
                    signal.setitimer(signal.ITIMER_REAL, max(outer_delay - spent, 1e-3), outer_interval)
        tracer = _TraceDeadline(deadline.end, TimeoutException)
        with tracer:
            result = call(None)
        if tracer.fired:  # raised, but something swallowed it: the result cannot be trusted
            raise deadline.expired()
        return result
    except TimeoutException:
        raise deadline.expired() from None


def _parse(text: str, deadline: _Deadline) -> list[Any]:
    """math-verify's ``parse`` of ``text`` within ``deadline``; [] when nothing parses."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from math_verify.errors import TimeoutException

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def call(timeout: int | None) -> list[Any]:
        try:
            return parse(text, extraction_config=configs, parsing_timeout=timeout, raise_on_error=True)
        except TimeoutException:
            raise
        except Exception:  # noqa: BLE001 - what math-verify does by default: unparsable is no answer
            return []

    return _bounded(call, deadline)


def _verify(gold: list[Any], pred: list[Any], deadline: _Deadline) -> bool:
    """math-verify's ``verify`` (any gold/pred pair equivalent), every pair within one budget."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for g, p in product(gold, pred):
        def call(timeout: int | None, g: Any = g, p: Any = p) -> bool:
            try:
                return bool(verify(g, p, timeout_seconds=timeout, raise_on_error=True))
            except TimeoutException:
                raise
            except Exception:  # noqa: BLE001 - what math-verify does by default: not equal
                return False

        if _bounded(call, deadline):
            return True
    return False


def _parse_first(texts: list[str], deadline: _Deadline) -> list[Any]:
    for text in texts:
        parsed = _parse(text, deadline)
        if parsed:
            return parsed
    return []


# -- the scorer -----------------------------------------------------------------------------------

def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any] | None = None, *, score: float = 1.0,
                  format_score: float = 0.0, parse_timeout_s: float = PARSE_TIMEOUT_S,
                  verify_timeout_s: float = VERIFY_TIMEOUT_S,
                  max_response_chars: int = MAX_RESPONSE_CHARS, **kwargs: Any) -> dict[str, Any]:
    """``score`` if the last answer in ``solution_str`` (boxed, ``$...$``, or a bare expression)
    equals ``ground_truth``; ``format_score`` if an answer was found but differs; else 0.
    ``ScoreError("timeout")`` if parsing or comparing runs over its budget (see the module
    docstring); ``ScoreError("bad_ground_truth")`` if the reference does not parse."""
    if ground_truth is None:
        raise ScoreError("no_ground_truth", "a math record needs ground_truth")
    ground_truth = str(ground_truth)  # some datasets store a bare number
    parsing = _Deadline(parse_timeout_s, "parsing")
    gold_text, gold_unit = normalize_answer(ground_truth_answer(ground_truth))
    # a reference that still has "$" is prose around math: math-verify's extraction reads it
    wrappers = [gold_text] if "$" in gold_text else [f"\\boxed{{{gold_text}}}", f"${gold_text}$", gold_text]
    gold = _parse_first(wrappers, parsing) if gold_text else []
    if not gold:
        raise ScoreError("bad_ground_truth", f"math-verify cannot parse the ground truth {ground_truth[:80]!r}")

    text = solution_str[-max_response_chars:] if max_response_chars > 0 else solution_str
    spans = boxed_spans(text)
    pred, pred_unit = [], None
    if spans:
        boxed_text, pred_unit = normalize_answer(text[spans[-1][0]:spans[-1][1]])
        if boxed_text:
            pred = _parse(f"\\boxed{{{boxed_text}}}", parsing)
    if not pred:
        pred, pred_unit = _parse(normalize_latex(text), parsing), None
    if not pred:
        return {"score": 0.0, "pred": None}
    shown = str(pred[-1])
    if gold_unit and pred_unit and gold_unit != pred_unit:  # 5 m is not 5 cm
        return {"score": float(format_score), "pred": shown}
    ok = _verify(gold, pred, _Deadline(verify_timeout_s, "comparison"))
    return {"score": float(score if ok else format_score), "pred": shown}
