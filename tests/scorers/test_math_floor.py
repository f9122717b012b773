"""math-verify's verdict is the math scorer's floor (issue 22): over every answer pair the suite
holds (the 78 hand-graded rows, the issue's examples, ~300 generated pairs of numbers with
separators, sets, tuples, intervals, assignments and answers over several boxes), wherever
math-verify, reading both sides as it documents, says "equal", so does streamrl, except for the
rows listed in ``VETOED`` (a documented rule says why); and the pairs where streamrl says "equal"
and math-verify does not are exactly those marked with the rule expected to add them.

The oracle below calls math-verify directly, not through streamrl: the ground truth as
``\\boxed{gt}`` (verl's ``math_verify`` does the same) and, where it is written in LaTeX
(``$...$``, boxes), also whole, as math-verify's README reads gold; the response with
``LatexExtractionConfig(boxed_match_priority=0)`` + ``ExprExtractionConfig`` and with
math-verify's default order; equal if either reading verifies.
"""

from __future__ import annotations

import functools

import pytest

from streamrl.scorers.math_verify import _ADDITIONS, judge
from tests.scorers.math_pairs import HAND_ADDED, ISSUE, VETOED, Pair, all_pairs, generated, math_verify_says_equal

PAIRS = all_pairs()
#: one worker under xdist: ``verdicts()`` (math-verify over every pair, a minute or two of CPU) is
#: computed once for the three tests that read it, not once per worker
pytestmark = pytest.mark.xdist_group("math_floor")


@functools.cache
def verdicts() -> list[tuple[Pair, bool, bool, str]]:
    """(pair, math-verify's verdict, streamrl's verdict, the rule streamrl names)."""
    out = []
    for pair in PAIRS:
        equal, why, _ = judge(pair.response, pair.ground_truth)
        out.append((pair, math_verify_says_equal(pair.response, pair.ground_truth), equal, why))
    return out


def _key(pair: Pair) -> tuple[str, str]:
    return (pair.response, pair.ground_truth)


def test_the_suite_holds_the_forms_of_the_issue():
    families = {p.family for p in PAIRS}
    assert {"separators", "sets", "tuples", "intervals", "assignments", "boxes"} <= families
    assert len(PAIRS) >= 78 + len(ISSUE) + 250
    assert generated() == generated()  # a fixed seed: every run sees the same pairs
    for family in families - {p.family for p in PAIRS if p.family.startswith("hand:")}:
        assert {p.correct for p in PAIRS if p.family == family} == {True, False}, family  # right and wrong


def test_where_math_verify_says_equal_streamrl_does_unless_a_documented_rule_vetoes():
    lost = []
    for pair, mv, ours, why in verdicts():
        if mv and not ours:
            vetoed = next((rule for (ans, gt), rule in VETOED.items()
                           if f"{{{ans}}}" in pair.response and gt == pair.ground_truth), None)
            if vetoed != why:
                lost.append((pair, why))
    assert lost == []
    assert sum(1 for _, mv, ours, _ in verdicts() if mv and not ours) == len(VETOED)


def test_the_equivalences_streamrl_adds_are_exactly_the_listed_ones():
    added = {_key(pair): why for pair, mv, ours, why in verdicts() if ours and not mv}
    expected = {_key(pair): pair.added for pair in PAIRS if pair.added}
    assert added == expected
    assert set(expected.values()) <= set(_ADDITIONS)
    assert set(expected.values()) == set(_ADDITIONS)  # every rule is exercised by some pair
    assert HAND_ADDED == {}


def test_streamrl_agrees_with_every_expected_verdict():
    wrong = [(pair.family, pair.response, pair.ground_truth, pair.correct)
             for pair, _, ours, _ in verdicts() if ours is not pair.correct]
    assert wrong == []
