"""The MATH rule against hand-graded verdicts, side by side with verl's math scorers.

Each row is an answer (or a whole response), a ground truth written the way MATH / DAPO write
them, and the verdict a careful human grader gives. streamrl's rule must agree with every
verdict, unconditionally. When verl is importable (``pip install --no-deps verl``; its full
install pulls Ray, torch and transformers, so it is not a dev dependency), the same rows are
scored by verl's ``math_dapo``, ``math_reward`` (``math.py`` in older verl) and its math-verify
wrapper, loaded from their files (``verl/__init__`` imports Ray and torch; these three modules
import only ``re`` / ``math_verify``), and streamrl must agree with the hand at least as often as
the best of them.
"""

from __future__ import annotations

from typing import Callable

import pytest

from streamrl.scorers import ScoreError
from streamrl.scorers.math_verify import compute_score
from tests.scorers.math_pairs import ROWS, Row, verl_scorers


REQUIRED_CASES = {"money", "units", "choice", "degrees", "fractions", "decimals", "intervals", "sets",
                  "tuples", "negatives", "thousands", "boxed"}


def streamrl_verdict(row: Row) -> bool:
    return compute_score("math", row.response(), row.ground_truth)["score"] == 1.0


def test_the_table_covers_the_cases_with_both_verdicts():
    assert len(ROWS) >= 40
    assert REQUIRED_CASES <= {r.case for r in ROWS}
    for case in REQUIRED_CASES:  # every case has a right and a wrong answer
        assert {r.correct for r in ROWS if r.case == case} == {True, False}, case


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.case}:{r.answer[:30]}|{r.ground_truth[:20]}" for r in ROWS])
def test_streamrl_agrees_with_the_hand_verdict(row: Row):
    assert streamrl_verdict(row) is row.correct


@pytest.mark.parametrize("ground_truth", ["\\$10", "\\$1{,}000.50", "5\\text{ cm}", "\\text{(A)}",
                                          "30^\\circ", "30^{\\circ}", "\\dfrac{1}{2}", "\\tfrac{1}{2}",
                                          "\\left( 1, 2 \\right)", "1{,}000", "1,\\!000"])
def test_math_and_dapo_ground_truths_parse(ground_truth: str):
    """These were dead-lettered as bad_ground_truth (``\\$``) or relied on luck; each must parse
    and be matched by its own value written plainly."""
    plain = {"\\$10": "10", "\\$1{,}000.50": "1000.5", "5\\text{ cm}": "5", "\\text{(A)}": "A",
             "30^\\circ": "30", "30^{\\circ}": "30", "\\dfrac{1}{2}": "0.5", "\\tfrac{1}{2}": "0.5",
             "\\left( 1, 2 \\right)": "(1,2)", "1{,}000": "1000", "1,\\!000": "1000"}[ground_truth]
    assert compute_score("math", f"$\\boxed{{{plain}}}$", ground_truth)["score"] == 1.0
    assert compute_score("math", "$\\boxed{7}$", ground_truth)["score"] == 0.0


def test_a_ground_truth_with_no_math_is_still_a_data_error():
    with pytest.raises(ScoreError) as err:
        compute_score("math", "$\\boxed{1}$", "\\text{}")
    assert err.value.reason == "bad_ground_truth"


# -- verl, side by side ----------------------------------------------------------------------------

def _agreement(verdict: Callable[[Row], bool]) -> tuple[int, list[str]]:
    agree, misses = 0, []
    for row in ROWS:
        try:
            got = verdict(row)
        except Exception as exc:  # noqa: BLE001 - a scorer that raises has not agreed
            got = f"raised {type(exc).__name__}"
        if got is row.correct:
            agree += 1
        else:
            misses.append(f"{row.case}: {row.answer!r} vs {row.ground_truth!r} -> {got}")
    return agree, misses


def test_streamrl_agrees_with_the_hand_at_least_as_often_as_verl(capsys: pytest.CaptureFixture[str]):
    scorers = verl_scorers()
    if not scorers:
        pytest.skip("verl is not importable: `pip install --no-deps verl` to compare with its math scorers "
                    "(streamrl's verdicts are checked against the hand table above regardless)")
    ours, our_misses = _agreement(streamrl_verdict)
    counts = {"streamrl math": ours}
    with capsys.disabled():
        print(f"\nagreement with {len(ROWS)} hand verdicts:")
        for name, scorer in scorers.items():
            counts[name], misses = _agreement(lambda row, scorer=scorer: scorer(row.response(), row.ground_truth))
            print(f"  {name}: {counts[name]}/{len(ROWS)}")
            for miss in misses:
                print(f"      {miss}")
        print(f"  streamrl math: {ours}/{len(ROWS)}")
    assert our_misses == []
    assert ours >= max(counts.values())
    assert ours >= 0.95 * len(ROWS)
