"""Math: is the response's final answer equivalent to the reference?

math-verify's verdict is the floor. The response and the ground truth are read the way
math-verify documents and verl's ``math_verify`` calls it: the ground truth as ``\\boxed{gt}``, the
whole response (its last ``max_response_chars``) through ``LatexExtractionConfig`` (every
``\\boxed{}``, ``$...$`` and "final answer is" form, answers joined by "and" / "," read as one set,
its own LaTeX normalisation: units, ``\\!`` thousands separators, ``\\dfrac`` ...) and
``ExprExtractionConfig`` (plain numbers such as ``10,455``), then ``verify``. Where math-verify
says "equal", so does this scorer, with one documented exception (``_different_units``:
``5\\text{ m}`` is not ``5\\text{ cm}``; math-verify drops units). Where it says "different" or cannot parse,
streamrl's own rules may only *add* an equivalence, each one in ``_ADDITIONS``:

- ``math_notation``: the last box and the ground truth normalised the way MATH and DAPO write
  answers (what verl's ``math_dapo.normalize_final_answer`` and MATH's ``strip_string`` handle):
  escaped dollars (``\\$10``), ``\\text{...}`` units and choices (``\\text{(A)}``), degrees,
  ``\\left`` / ``\\right``, control spaces and digit groups (``1\\,234``, ``1\\ 234``: math-verify
  reads 1 + 234), then compared by math-verify. Without it ``\\$10`` as a ground truth does not
  parse at all and the record is dead-lettered.
- ``spread_boxes``: a ground truth of n >= 2 items (``1,-2``, ``\\{1,2,3\\}``, ``k = 45, n = 2``)
  against the response's last n top-level boxes, whatever text separates them (math-verify joins
  boxes only when "and", "or" or "," alone stand between them).

Bounded time. SymPy can run away on adversarial input (``[2^{\\frac{1}{2^{1000}}}, \\infty)``
against ``[1, +\\infty)`` grew to 4 GB in 30 s), so parsing and comparing each have a budget
(``parse_timeout_s``, ``verify_timeout_s``; scorer kwargs). math-verify's own one-shot
``signal.alarm`` is not used: the exception it raises can land inside a weakref callback or a
``__del__`` (SymPy's caches make many), where Python prints it and carries on, and nothing ends the
work any more. Instead, on a main thread (the reward stage's worker processes, where pebble runs
the task on the forked worker's main thread, and ``default_compute_score``) a repeating timer
raises at the deadline and every 50 ms after until the work has stopped, and a timer the caller
had armed is put back afterwards; off the main thread (the ``thread`` executor), where signals
cannot be used, a trace function raises at the first call into math-library code after the
deadline, and because CPython switches a tracer off once it raises, a profile function re-arms
it until the work has stopped. Either raises only in SymPy / math-verify code, never inside a
lock-holding section of ``logging`` or ``threading``. Running out of budget is ``Failure("timeout")``, which the stage retries,
then dead-letters or maps to a configured fallback; never a silent 0.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import sys
import threading
import time
from itertools import product
from types import FrameType
from typing import Any, Callable, TypeVar

from streamrl.errors import Failure
from streamrl.scorers.base import ground_truth_text
from streamrl.scorers.gsm8k import boxed_spans

VERSION = "3"  # 3: math-verify's verdict is the floor; streamrl only adds equivalences

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
# "11,\! 111" is one number: the comma of a thin-spaced separator keeps no space after it
_THIN_COMMA = re.compile(r"(?<=\d),\\!\s*(?=\d{3}(?!\d))")
# digit groups set apart by a control or thin space: "1\,234", "1\ 234", "1~234" (SI style)
_SPACED_GROUPS = re.compile(r"(?<=\d)(?:\\[,;:! ]|~|[\u2009\u202f])(?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DISPLAY_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DISPLAY_BINOM = re.compile(r"\\[dt]binom(?![A-Za-z])")


def normalize_latex(text: str) -> str:
    """Rewrites that are safe anywhere in a response: escaped dollars, display-style fractions,
    ``\\left`` / ``\\right``, degree marks, thin and control spaces, digit groups set apart by
    them (``1\\,234``), braced and thin-spaced thousands commas (``1{,}000``, ``1,\\! 000``),
    Unicode minus."""
    text = text.replace("\\$", "").replace("\u2212", "-").replace("\\displaystyle", "")
    text = _SPACED_GROUPS.sub("", _THIN_COMMA.sub(",", text))
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
        # signals work only on the main thread of the main interpreter
        self.signals = threading.current_thread() is threading.main_thread()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> Failure:
        return Failure("timeout", f"math-verify {self.phase} ran over {self.seconds:g} s")


#: Where a deadline may interrupt: only on entering (or, for the alarm, while running) code of
#: the math libraries. An exception raised anywhere else (between a lock's acquire and release in
#: ``logging`` or ``threading``, inside ``sys.unraisablehook``) could leave the process broken;
#: raised here it is no different from an error SymPy itself raises.
_INTERRUPTIBLE = ("sympy", "mpmath", "math_verify", "latex2sympy2_extended", "antlr4")


def _interruptible(frame: FrameType | None) -> bool:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(name, str) and name.split(".", 1)[0] in _INTERRUPTIBLE


class _AlarmDeadline:
    """Main thread: ``SIGALRM`` at the deadline and every ``REPEAT_S`` after, each raising
    math-verify's ``TimeoutException`` (a ``BaseException``, so SymPy's ``except Exception`` does
    not swallow it) if math-library code is running, until ``disarm``. One shot is not enough:
    a handler that runs while a weakref callback or ``__del__`` executes raises there, and Python
    swallows it. The caller's handler and timer (pytest-timeout, a supervisor) are put back, the
    timer minus the time spent."""

    REPEAT_S = 0.05

    def __init__(self, end: float, exc: type[BaseException]):
        self.end, self.exc, self.active = end, exc, False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.active and _interruptible(frame):
            raise self.exc("streamrl: math-verify deadline")

    def arm(self) -> None:
        self.outer_handler = signal.getsignal(signal.SIGALRM)
        self.outer_delay, self.outer_interval = signal.getitimer(signal.ITIMER_REAL)
        self.started = time.monotonic()
        self.active = True
        signal.signal(signal.SIGALRM, self._handler)
        signal.setitimer(signal.ITIMER_REAL, max(self.end - time.monotonic(), 1e-3), self.REPEAT_S)

    def disarm(self) -> None:
        while True:  # a tick may still land here before ``active`` is cleared: then do it again
            try:
                self.active = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self.outer_handler if self.outer_handler is not None else signal.SIG_DFL)
                if self.outer_delay > 0:
                    spent = time.monotonic() - self.started
                    signal.setitimer(signal.ITIMER_REAL, max(self.outer_delay - spent, 1e-3), self.outer_interval)
                return
            except self.exc:
                continue


class _TraceDeadline:
    """Off the main thread: a trace function that raises math-verify's ``TimeoutException`` on
    the first call into math-library code after the deadline. CPython switches a trace function
    off once it raises; if the exception is then swallowed (raised inside a weakref callback or a
    ``__del__``, where Python only prints it) nothing would stop the work any more: the cause of a
    20 s budget once taking 120 s. So after firing, a profile function (its own slot, which never
    raises) re-arms the tracer whenever it finds it off, until ``disarm``. Before the deadline
    only the tracer runs, on call events. A tracer or profiler already installed (a debugger,
    coverage) is chained to and put back afterwards."""

    def __init__(self, end: float, exc: type[BaseException]):
        self.end, self.exc, self.active, self.fired = end, exc, False, False
        self.previous_trace: Callable[..., Any] | None = None
        self.previous_profile: Callable[..., Any] | None = None

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.active and time.monotonic() > self.end and _interruptible(frame):
            if not self.fired:
                self.fired = True
                sys.setprofile(self._rearm)
            raise self.exc("streamrl: math-verify deadline")
        return self.previous_trace(frame, event, arg) if self.previous_trace is not None else None

    def _rearm(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.active and sys.gettrace() is None:
            sys.settrace(self._trace)

    def arm(self) -> None:
        self.previous_trace, self.previous_profile = sys.gettrace(), sys.getprofile()
        self.active = True
        sys.settrace(self._trace)

    def disarm(self) -> None:
        self.active = False
        sys.setprofile(self.previous_profile)
        sys.settrace(self.previous_trace)


def _bounded(call: Callable[[], T], deadline: _Deadline) -> T:
    """``call()`` (math-verify with its own timeouts off) within ``deadline``: running out is
    ``Failure("timeout")``."""
    from math_verify.errors import TimeoutException

    left = deadline.remaining()
    if left <= 0:
        raise deadline.expired()
    if math.isinf(left):
        return call()
    guard = (_AlarmDeadline if deadline.signals else _TraceDeadline)(deadline.end, TimeoutException)
    try:
        try:
            guard.arm()
            return call()
        finally:
            guard.disarm()
    except TimeoutException:
        raise deadline.expired() from None


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; here they are replaced."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def _parse(text: str, deadline: _Deadline, configs: tuple[Any, ...] | None = None) -> list[Any]:
    """math-verify's ``parse`` of ``text`` within ``deadline``; [] when nothing parses."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from math_verify.errors import TimeoutException

    chosen = configs if configs is not None else (LatexExtractionConfig(), ExprExtractionConfig())

    def call() -> list[Any]:
        try:
            return parse(text, extraction_config=chosen, parsing_timeout=None, raise_on_error=True)
        except (TimeoutException, MemoryError):  # out of memory is not "unparsable"
            raise
        except Exception:  # noqa: BLE001 - what math-verify does by default: unparsable is no answer
            return []

    return _bounded(call, deadline)


def _verify(gold: list[Any], pred: list[Any], deadline: _Deadline) -> bool:
    """math-verify's ``verify`` (any gold/pred pair equivalent), every pair within one budget."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for g, p in product(gold, pred):
        def call(g: Any = g, p: Any = p) -> bool:
            try:
                return bool(verify(g, p, timeout_seconds=None, raise_on_error=True))
            except (TimeoutException, MemoryError):  # out of memory is not "different"
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


# -- math-verify's reading: the floor --------------------------------------------------------------

_FINAL_ANSWER = re.compile(r"(?i)final\s+answer")
_LATEX_ANCHOR = re.compile(r"\$|\\\(|\\\[|\\boxed")


def _gold_configs() -> tuple[Any, ...]:
    """How math-verify's README reads a gold answer written in LaTeX (``$...$``, boxes)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def _response_readings(text: str) -> list[tuple[Any, ...]]:
    """The extraction configs math-verify documents for a model's output: boxed answers first
    (``boxed_match_priority=0``), and, where the response also says "final answer" (the only
    patterns that rank between the two), math-verify's default order as verl calls it."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    readings: list[tuple[Any, ...]] = [(LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())]
    if "\\boxed" in text and _FINAL_ANSWER.search(text):
        readings.append((ExprExtractionConfig(), LatexExtractionConfig()))
    return readings


def _math_verify_equal(text: str, gold: list[Any], parsing: _Deadline, comparing: _Deadline) -> tuple[bool, list[Any]]:
    """math-verify's own verdict on ``text`` (a response's tail) against the parsed ground truth,
    and what it read; no streamrl rule takes part."""
    pred: list[Any] = []
    for configs in _response_readings(text):
        pred = _parse(text, parsing, configs)
        if gold and pred and _verify(gold, pred, comparing):
            return True, pred
    return False, pred


# -- streamrl's additions ----------------------------------------------------------------------------

def _different_units(gold_unit: str | None, pred_unit: str | None) -> bool:
    """The one rule that overrides a math-verify "equal": both answers name a known unit and the
    units differ (``5\\text{ m}`` against ``5\\text{ cm}``). math-verify strips units before
    comparing, so it calls these equal; a grader does not."""
    return bool(gold_unit and pred_unit and gold_unit != pred_unit)


def _top_level_boxes(text: str) -> list[str]:
    """The contents of the boxes not inside another box, in order."""
    out: list[str] = []
    end = -1
    for a, b in boxed_spans(text):
        if a >= end:
            out.append(text[a:b])
            end = b
    return out


def _items(answer: str) -> int:
    """How many items a ground truth lists: top-level commas (and "and") of its normalised
    text, an enclosing ``\\{...\\}`` set removed. ``(1, 2)`` is one item, ``(1,2),(2,1)`` two."""
    text = answer.strip()
    if text.startswith("\\{") and text.endswith("\\}"):
        text = text[2:-2]
    text = re.sub(r"\\text\{\s*and\s*\}|\band\b", ",", text)
    depth, count = 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0 and text[i - 1:i] != "\\":
            count += 1
    return count


def _normalised_box(content: str) -> str:
    value, _ = normalize_answer(content)
    return value


_ADDITIONS = ("math_notation", "spread_boxes")


def _streamrl_equal(text: str, gold_text: str, golds: list[list[Any]], parsing: _Deadline,
                    comparing: _Deadline) -> tuple[str | None, list[Any]]:
    """The first of ``_ADDITIONS`` that finds ``text`` equal to the ground truth (its name), and
    the answer it read. Only asked where math-verify said "different" or could not parse."""
    boxes = _top_level_boxes(text)
    pred: list[Any] = []
    # math_notation: the last box (else the whole tail) in MATH/DAPO notation
    if boxes:
        boxed = _normalised_box(boxes[-1])
        if boxed:
            pred = _parse(f"\\boxed{{{boxed}}}", parsing)
    if not pred:
        pred = _parse(normalize_latex(text), parsing)
    if pred and any(gold and _verify(gold, pred, comparing) for gold in golds):
        return "math_notation", pred
    # spread_boxes: an n-item ground truth against the last n boxes
    n = _items(gold_text)
    if n >= 2 and len(boxes) >= n:
        joined = ", ".join(_normalised_box(b) for b in boxes[-n:])
        spread = _parse(f"\\boxed{{{joined}}}", parsing)
        if spread and any(gold and _verify(gold, spread, comparing) for gold in golds):
            return "spread_boxes", spread
    return None, pred


# -- the scorer -----------------------------------------------------------------------------------

def judge(solution_str: str, ground_truth: str, *, parse_timeout_s: float = PARSE_TIMEOUT_S,
          verify_timeout_s: float = VERIFY_TIMEOUT_S,
          max_response_chars: int = MAX_RESPONSE_CHARS) -> tuple[bool, str, list[Any]]:
    """``(equal, why, read)``: the verdict, which rule gave it (``"math-verify"``, one of
    ``_ADDITIONS``, ``"units"`` for the veto, ``"different"``, or ``"no answer"``) and the answer
    read. Raises ``Failure`` like ``compute_score``."""
    parsing = _Deadline(parse_timeout_s, "parsing")
    comparing = _Deadline(verify_timeout_s, "comparison")
    answer = ground_truth_answer(ground_truth)
    gold_mv = _parse(f"\\boxed{{{answer}}}", parsing) if answer.strip() else []
    # a reference written as math-verify's README writes gold ("$...$", boxes): also read whole
    gold_direct = _parse(ground_truth, parsing, _gold_configs()) if _LATEX_ANCHOR.search(ground_truth) else []
    gold_text, gold_unit = normalize_answer(answer)

    read_gold: list[list[Any]] = []

    def streamrl_gold() -> list[Any]:
        """The ground truth in streamrl's notation, read once and only where needed."""
        if read_gold:
            return read_gold[0]
        # a reference that still has "$" is prose around math: math-verify's extraction reads it
        wrappers = [gold_text] if "$" in gold_text else [f"\\boxed{{{gold_text}}}", f"${gold_text}$", gold_text]
        gold = _parse_first(wrappers, parsing) if gold_text else []
        if not gold and not gold_mv and not gold_direct:
            raise Failure("bad_ground_truth", f"math-verify cannot parse the ground truth {ground_truth[:80]!r}")
        read_gold.append(gold)
        return gold

    if not gold_mv and not gold_direct:
        streamrl_gold()  # raises if streamrl's notation cannot read it either

    text = solution_str[-max_response_chars:] if max_response_chars > 0 else solution_str
    boxes = _top_level_boxes(text)
    pred_unit = normalize_answer(boxes[-1])[1] if boxes else None
    equal, pred = _math_verify_equal(text, gold_mv, parsing, comparing)
    if not equal and gold_direct:
        equal, pred = _math_verify_equal(text, gold_direct, parsing, comparing)
    if equal:
        if _different_units(gold_unit, pred_unit):
            return False, "units", pred
        return True, "math-verify", pred
    rule, read = _streamrl_equal(text, gold_text, [gold_mv, gold_direct, streamrl_gold()], parsing, comparing)
    if rule is not None and not _different_units(gold_unit, pred_unit):
        return True, rule, read
    pred = pred or read
    return False, "different" if pred else "no answer", pred


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any] | None = None, *, score: float = 1.0,
                  format_score: float = 0.0, parse_timeout_s: float = PARSE_TIMEOUT_S,
                  verify_timeout_s: float = VERIFY_TIMEOUT_S,
                  max_response_chars: int = MAX_RESPONSE_CHARS, method: str = "math_verify",
                  **kwargs: Any) -> dict[str, Any]:
    """``score`` if ``solution_str``'s final answer equals ``ground_truth`` (see the module
    docstring: math-verify's verdict, plus streamrl's documented additions); ``format_score`` if
    an answer was found but differs; else 0. ``Failure("timeout")`` if parsing or comparing
    runs over its budget; ``Failure("bad_ground_truth")`` if the reference does not parse.
    ``method="verl"`` is verl's own MATH rule instead (``math_reward``: verl's mode)."""
    if method == "verl":
        from streamrl.scorers import math_reward

        return math_reward.compute_score(data_source, solution_str, ground_truth, extra_info)
    if method != "math_verify":
        raise ValueError(f"math method must be 'math_verify' or 'verl', got {method!r}")
    equal, _, pred = judge(solution_str, ground_truth_text(ground_truth, data_source),  # a bare number reads as text
                           parse_timeout_s=parse_timeout_s, verify_timeout_s=verify_timeout_s,
                           max_response_chars=max_response_chars)
    if not pred:
        return {"score": 0.0, "pred": None}
    return {"score": float(score if equal else format_score), "pred": str(pred[-1])}
