"""The gsm8k rule scorer: the GSM8K test split's own solutions, answer forms models write, and
verl parity; and the math scorer's equivalences (math-verify)."""

from __future__ import annotations


import pytest

from streamrl.datasets import read_rows
from streamrl.scorers import ScoreError, default_compute_score
from streamrl.scorers.gsm8k import compute_score, verl_ground_truth
from tests.helpers import gsm8k_path

def _split() -> list[dict]:
    return read_rows(str(gsm8k_path("test")))  # the real split, from shared/ beside the clone


def test_every_reference_solution_scores_one_against_its_own_number():
    rows = _split()
    assert len(rows) == 1319
    wrong = []
    for row in rows:
        number = row["answer"].rsplit("####", 1)[1].strip()
        # the number alone (as verl's preprocessing stores it), and the whole solution as ground truth
        for gt in (number, row["answer"]):
            if compute_score("gsm8k", row["answer"], gt)["score"] != 1.0:
                wrong.append((number, gt[-40:]))
        # the same solution without its "#### N" line still reads its final number
        body = row["answer"].rsplit("####", 1)[0]
        if compute_score("gsm8k", f"{body}The answer is {number}.", number)["score"] != 1.0:
            wrong.append(("answer-is", number))
    assert wrong == []


def test_reference_solutions_score_zero_against_another_number():
    rows = _split()[:200]
    for row in rows:
        number = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        other = str(int(number) + 1)
        assert compute_score("gsm8k", row["answer"], other)["score"] == 0.0


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("#### 42", "42", 1.0),
    ("Step 1... Step 2...\n#### 42", "42", 1.0),
    ("The answer is 42", "42", 1.0),
    ("So the final answer is 42.", "42", 1.0),
    ("A: 42", "42", 1.0),
    ("Answer: 42", "42", 1.0),
    ("**Answer:** 42", "42", 1.0),
    ("Therefore $\\boxed{42}$.", "42", 1.0),
    ("\\boxed{\\$1,000}", "1000", 1.0),
    ("\\boxed{72 \\text{ dollars}}", "72", 1.0),
    ("The answer is 1,234,567.", "1234567", 1.0),
    ("The answer is 1234567", "1,234,567", 1.0),
    ("She makes $18 every day.", "18", 1.0),
    ("The total is \u20ac250.", "250", 1.0),
    ("The answer is 18 dollars.", "18", 1.0),
    ("He walks 12 km.", "12", 1.0),
    ("The answer is 42.", "#### 42", 1.0),
    ("The answer is -5", "-5", 1.0),
    ("The temperature drops to \u22127 degrees.", "-7", 1.0),
    ("It costs $-3", "-3", 1.0),
    ("The answer is 2.5", "2.5", 1.0),
    ("The answer is 72.0", "72", 1.0),
    ("The answer is 72.00.", "72", 1.0),
    ("#### 0.50", "0.5", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("5 + 3 = 8. The answer is 5 + 3 = 8.", "8", 1.0),
    ("#### 42\nHmm, or maybe 41.", "42", 1.0),  # the marked answer wins over later chatter
    ("Janet has 3 ducks, then 4 more, so 7 ducks", "7", 1.0),  # the last number
    # wrong answers
    ("#### 41", "42", 0.0),
    ("The answer is 4.2", "42", 0.0),
    ("The answer is -42", "42", 0.0),
    ("The answer is 420", "42", 0.0),
    ("\\boxed{43}", "42", 0.0),
    ("I do not know.", "42", 0.0),
    ("", "42", 0.0),
    ("The answer is 1,235.", "1234", 0.0),
])
def test_answer_forms(response, ground_truth, expected):
    assert compute_score("gsm8k", response, ground_truth)["score"] == expected


def test_format_score_and_pred():
    out = compute_score("gsm8k", "The answer is 41", "42", format_score=0.1)
    assert out == {"score": 0.1, "pred": "41"}
    assert compute_score("gsm8k", "no number", "42", format_score=0.1) == {"score": 0.0, "pred": None}


def test_a_ground_truth_without_a_number_is_an_error_not_a_zero():
    with pytest.raises(ScoreError) as err:
        compute_score("gsm8k", "#### 4", "four")
    assert err.value.reason == "bad_ground_truth"


@pytest.mark.parametrize("response, ground_truth, method, expected", [
    # strict wants "#### N" (with the space), takes the last one, drops "," and "$"
    ("#### 42", "42", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),
    ("#### 10\n#### 42", "42", "strict", 1.0),
    ("####42", "42", "strict", 0.0),
    ("The answer is 42", "42", "strict", 0.0),
    ("\\boxed{42}", "42", "strict", 0.0),
    # string comparison: the same value written differently is wrong in verl
    ("#### 72.0", "72", "strict", "format"),
    ("#### 41", "42", "strict", "format"),
    # only the last 300 characters are read
    ("#### 42" + " filler" * 60, "42", "strict", 0.0),
    # flexible: the last number-like token, commas kept
    ("so 40 + 2 = 42", "42", "flexible", 1.0),
    ("It is 1,234", "1234", "flexible", "format"),
    ("The answer is 42.", "42", "flexible", "format"),  # "42." is the token
    ("no digits here", "42", "flexible", 0.0),
])
def test_verl_parity(response, ground_truth, method, expected):
    want = 0.25 if expected == "format" else expected
    got = compute_score("gsm8k", response, ground_truth, method=method, format_score=0.25)["score"]
    assert got == want


def test_verl_parity_on_the_split_matches_verls_preprocessed_ground_truth():
    """verl's data preprocessing stores the number without commas; its strict extraction also
    drops commas, its flexible one does not (a known verl quirk, reproduced)."""
    flexible_misses = 0
    for row in _split():
        gt = verl_ground_truth(row["answer"])
        assert "," not in gt
        assert compute_score("gsm8k", row["answer"], gt, method="strict")["score"] == 1.0
        flexible_misses += compute_score("gsm8k", row["answer"], gt, method="flexible")["score"] != 1.0
    assert flexible_misses == 14  # the 14 answers written with thousands separators


def test_default_compute_score_dispatches_like_verl():
    assert default_compute_score("openai/gsm8k", "#### 7", "7")["score"] == 1.0
    with pytest.raises(ScoreError) as err:
        default_compute_score("nope", "#### 7", "7")
    assert err.value.reason == "unknown_data_source"


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
    ("So $x = \\boxed{3}$", "3", 1.0),
    ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}", 1.0),
    ("$\\boxed{(1, 2]}$", "(1,2]", 1.0),
    ("The answer is $\\boxed{\\frac{1}{3}}$.", "0.5", 0.0),
    ("I give up", "0.5", 0.0),
])
def test_math_equivalence(response, ground_truth, expected):
    assert default_compute_score("math", response, ground_truth)["score"] == expected
