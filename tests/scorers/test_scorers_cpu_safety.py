"""The rule scorers cannot be made to burn CPU or memory without bound by what a model writes.

- gsm8k's robust extraction runs inline on the reward stage's event loop, so it must be linear in
  the response. Timing one run against a goal would be flaky; instead each adversarial family is
  timed at n and 16n characters in the same run: linear work gives a ratio near 16, the quadratic
  patterns it replaced gave ~256 (16k newlines took 1.5 s, 64k took 24 s); the bound, 64, sits
  midway on a log scale. The clock is the thread's CPU time, not the wall: on a loaded machine a
  1 ms run fits in one scheduler slice while a 20 ms one is preempted, which once made a linear
  family look 3x slower than it is.
- the math rule (math-verify / SymPy) has a budget for parsing and for comparing; running out is
  ``ScoreError("timeout")``, on the main thread (math-verify's signal.alarm), in a worker thread
  (the ``thread`` executor) and in a worker process (the ``process`` executor, the default).
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import threading
import time
from typing import Any, Callable

import pytest

from streamrl.scorers import ScoreError
from streamrl.scorers import gsm8k
from streamrl.scorers import math_verify
from streamrl.scorers.loader import FunctionScorer, ProcessRunner

# -- gsm8k: linear extraction --------------------------------------------------------------------

N = 20_000  # characters; the test scores N and 16N (320k)

#: Adversarial families: a repeated unit (what made the old patterns rescan) and a tail with the
#: answer, so the whole text is always scanned and the result is known.
FAMILIES: dict[str, tuple[str, str, float]] = {
    "blank lines": ("\n", "#### 42", 1.0),  # (?:^|\n)\s* rescanned every run of newlines
    "indented blank lines": ("\n ", "#### 42", 1.0),
    "unclosed boxes": ("\\boxed{", "#### 42", 1.0),  # each box scanned to the end of the text
    "nested boxes": ("\\boxed{", "", 1.0),  # closed below: "\boxed{" * k + "42" + "}" * k
    "digits commas dots spaces": ("1,2.3 -4/ 5,000 ", "#### 42", 1.0),
    "answer markers": ("A:\n answer is \n", "#### 42", 1.0),
    "one long number": ("9", "", 0.0),  # int(str) is quadratic, and refused over 4300 digits
}


def _response(family: str, n: int) -> str:
    unit, tail, _ = FAMILIES[family]
    reps = n // len(unit)
    if family == "nested boxes":
        return unit * reps + "42" + "}" * reps
    return unit * reps + tail


def _best_cpu_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gsm8k_extraction_is_linear_in_the_response(family: str):
    expected = FAMILIES[family][2]
    small, large = _response(family, N), _response(family, 16 * N)
    assert len(large) >= 16 * N - 20
    assert gsm8k.compute_score("gsm8k", large, "42")["score"] == expected
    t_small = _best_cpu_time(lambda: gsm8k.compute_score("gsm8k", small, "42"))
    t_large = _best_cpu_time(lambda: gsm8k.compute_score("gsm8k", large, "42"))
    assert t_large / t_small < 64, (family, t_small, t_large)


def test_nested_boxes_are_matched_like_before():
    """The one-pass matcher keeps the old semantics: innermost box last, unclosed boxes skipped,
    escaped braces counted as braces."""
    assert gsm8k.boxed_contents("\\boxed{\\boxed{5}} and \\boxed{7") == ["\\boxed{5}", "5"]
    assert gsm8k.boxed_contents("\\boxed{\\text{\\$}18} \\fbox {3}") == ["\\text{\\$}18", "3"]
    assert gsm8k.boxed_contents("} \\boxed{a{b}c} }") == ["a{b}c"]
    assert gsm8k.compute_score("gsm8k", "\\boxed{\\boxed{5}}", "5")["score"] == 1.0


def test_a_number_too_long_to_be_an_answer_scores_zero_not_an_error():
    out = gsm8k.compute_score("gsm8k", "The answer is " + "1" * 5000, "1")
    assert out == {"score": 0.0, "pred": None}


def test_answer_lines_still_read_after_blank_lines():
    """The A: pattern is anchored per line now; blank or indented lines before it still work."""
    assert gsm8k.compute_score("gsm8k", "Work.\n\n\n   **Answer:** 42", "42")["score"] == 1.0
    assert gsm8k.compute_score("gsm8k", "A: 42\n\n", "42")["score"] == 1.0
    assert gsm8k.compute_score("gsm8k", "Q: 1 + 2?\n \t\nA: 3", "3")["score"] == 1.0


# -- math: bounded time ------------------------------------------------------------------------

# Without a budget this comparison grew to 4 GB in 30 s (SymPy evaluating 2^(1/2^1000)).
PATHOLOGICAL = {"data_source": "math", "ground_truth": "[1,+\\infty)",
                "solution_str": "The set is $\\boxed{[2^{\\frac{1}{2^{1000}}}, \\infty)}$."}
BUDGET = {"parse_timeout_s": 2, "verify_timeout_s": 1}
#: math-verify's own budget ended it (the comparison's, or, on a loaded machine, the parse's: CI
#: once took over 2 s to parse it, and so did a traced thread here beside two other tests), not
#: the executor's kill deadline
MATH_VERIFY_OWN = re.compile(r"math-verify (parsing|comparison) ran over")
# a generous bound on the whole call: the budgets plus SymPy start-up and a loaded machine
BOUND_S = 20.0


def _assert_timeout(call: Callable[[], Any]) -> ScoreError:
    start = time.monotonic()
    with pytest.raises(ScoreError) as err:
        call()
    elapsed = time.monotonic() - start
    assert err.value.reason == "timeout", err.value
    assert elapsed < BOUND_S, (elapsed, err.value.detail)
    return err.value


def test_a_runaway_comparison_on_the_main_thread_is_a_timeout():
    # parsing gets room to finish on a loaded machine (it took over 2 s in a loaded suite run): the
    # comparison is what runs away
    err = _assert_timeout(lambda: math_verify.compute_score(**PATHOLOGICAL, parse_timeout_s=10, verify_timeout_s=1))
    assert "comparison" in err.detail


def test_the_callers_alarm_survives_math_verifys_own():
    """math-verify cancels SIGALRM with alarm(0); the scorer re-arms a timer the caller had set
    (pytest-timeout, a supervisor), minus the time spent."""
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 300.0)
    try:
        assert math_verify.compute_score("math", "$\\boxed{\\frac{1}{2}}$", "0.5")["score"] == 1.0
        _assert_timeout(lambda: math_verify.compute_score(**PATHOLOGICAL, **BUDGET))
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 250.0 < left < 300.0
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh thread (not the main one) and return or raise what it did."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(BOUND_S * 2)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_runaway_comparison_in_a_worker_thread_is_a_timeout():
    """signal.alarm cannot be used off the main thread; the trace-function deadline bounds it,
    and the thread's own tracer (none, or coverage's) is back in place afterwards."""
    def work() -> tuple[ScoreError | None, bool]:
        before = sys.gettrace()
        try:
            math_verify.compute_score(**PATHOLOGICAL, **BUDGET)
        except ScoreError as exc:
            return exc, sys.gettrace() is before
        return None, sys.gettrace() is before

    start = time.monotonic()
    err, tracer_restored = _in_thread(work)
    assert time.monotonic() - start < BOUND_S
    assert err is not None and err.reason == "timeout" and MATH_VERIFY_OWN.match(err.detail), err
    assert tracer_restored


def test_a_parse_budget_too_small_is_a_timeout_not_a_bad_ground_truth():
    for run in (lambda f: f(), _in_thread):
        err = _assert_timeout(lambda: run(lambda: math_verify.compute_score(
            "math", "$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}", parse_timeout_s=1e-6)))
        assert "parsing" in err.detail


@pytest.mark.parametrize("where", ["main", "thread"])
def test_budgets_do_not_change_verdicts(where: str):
    """The deadline machinery (signals on the main thread, a tracer elsewhere) scores ordinary
    answers exactly as before."""
    cases = [("$\\boxed{\\frac{1}{2}}$", "0.5", 1.0), ("$\\boxed{(1, 2]}$", "(1,2]", 1.0),
             ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}", 1.0), ("$\\boxed{\\frac{1}{3}}$", "0.5", 0.0),
             ("$\\boxed{\\$10}$", "\\$10", 1.0), ("I give up", "0.5", 0.0)]

    def score_all() -> list[float]:
        return [math_verify.compute_score("math", r, gt)["score"] for r, gt, _ in cases]

    got = score_all() if where == "main" else _in_thread(score_all)
    assert got == [want for _, _, want in cases]
    # budgets switched off (math-verify's convention: <= 0) score the same
    off = [math_verify.compute_score("math", r, gt, parse_timeout_s=0, verify_timeout_s=0)["score"]
           for r, gt, _ in cases]
    assert off == got


def test_the_thread_executor_turns_a_runaway_into_a_timeout():
    """The reward stage's ``thread`` executor, budgets set through the entry's kwargs."""
    scorer = FunctionScorer("streamrl.scorers.math_verify:compute_score", name="math",
                            kwargs=dict(BUDGET), executor="thread", timeout_s=120.0)
    err = _assert_timeout(lambda: asyncio.run(scorer(
        PATHOLOGICAL["data_source"], PATHOLOGICAL["solution_str"], PATHOLOGICAL["ground_truth"])))
    assert MATH_VERIFY_OWN.match(err.detail), err.detail


def test_the_process_executor_turns_a_runaway_into_a_timeout_from_math_verify():
    """The default for the math rule: a forked pebble worker runs the task on its main thread, so
    math-verify's own alarm ends it, well before the worker's kill deadline (120 s here); the
    reason survives the trip back from the worker."""
    runner = ProcessRunner(1)
    try:
        err = _assert_timeout(lambda: asyncio.run(runner.call(
            "streamrl.scorers.math_verify:compute_score", {**PATHOLOGICAL, "extra_info": None, **BUDGET},
            120.0)))
        assert MATH_VERIFY_OWN.match(err.detail), err.detail  # not "the worker was killed"
    finally:
        runner.close()


def _swallowing_runaway(deadline_s: float, limit_s: float) -> Callable[[], str]:
    """SymPy work whose first interruption after the deadline lands inside a weakref callback
    (SymPy's caches make many), where Python prints an exception and carries on: what once made a
    20 s budget take 120 s. Until just past the deadline only callbacks run; then plain SymPy
    calls until ``limit_s``, returning "not stopped" if nothing ended it."""
    import types
    import weakref

    import sympy.core.cache

    def busy(ref: object) -> None:  # long enough that a one-shot alarm lands in it
        for _ in range(20_000):
            pass

    # a callback that counts as SymPy code (its globals are a SymPy module's)
    callback = types.FunctionType(busy.__code__, vars(sympy.core.cache))

    class Dropped:
        pass

    def work() -> str:
        start = time.monotonic()
        while time.monotonic() < start + deadline_s + 0.2:
            obj = Dropped()
            ref = weakref.ref(obj, callback)  # noqa: F841 - kept alive so the callback runs at del
            del obj
        while time.monotonic() < start + limit_s:
            sympy.Integer(3) + 1
        return "not stopped"

    return work


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_deadline_swallowed_in_a_weakref_callback_still_ends_the_work(where: str):
    from math_verify.errors import TimeoutException

    def bounded() -> str:
        return math_verify._bounded(_swallowing_runaway(0.3, 15.0), math_verify._Deadline(0.3, "comparison"))

    swallowed: list[type[BaseException] | None] = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: swallowed.append(unraisable.exc_type)
    start = time.monotonic()
    try:
        with pytest.raises(ScoreError) as err:
            bounded() if where == "main" else _in_thread(bounded)
    finally:
        sys.unraisablehook = previous_hook
    assert err.value.reason == "timeout"
    assert time.monotonic() - start < 3.0  # was the full 15 s: the first raise was swallowed
    assert TimeoutException in swallowed  # the case arose: a raise landed in the callback
