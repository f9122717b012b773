"""Answer pairs for the math scorer's property test: the issue's examples and generated pairs
(numbers with separators, sets, tuples, intervals, assignments, answers over several boxes),
each with the verdict a grader gives and, where streamrl's own rule (not math-verify) is expected
to find it equal, that rule's name. Generated from a fixed seed, so every run sees the same pairs.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify


#: The hand-graded table ``test_math_parity`` checks streamrl and verl against.
@dataclass(frozen=True)
class Row:
    case: str
    answer: str  # the final answer a model wrote, or a whole response when ``full``
    ground_truth: str
    correct: bool  # the hand verdict
    full: bool = False

    def response(self) -> str:
        """The response the scorers read. An answer alone is written the way each scorer's prompt
        asks for it: boxed (MATH, math-verify) and on a closing ``Answer:`` line (DAPO)."""
        if self.full:
            return self.answer
        return (f"Working through the problem step by step.\n\nThe final answer is "
                f"$\\boxed{{{self.answer}}}$.\n\nAnswer: {self.answer}")


R = Row
ROWS: list[Row] = [
    # money: MATH writes \$ in ground truths
    R("money", "10", "\\$10", True),
    R("money", "\\$10", "\\$10", True),
    R("money", "\\$10.00", "\\$10", True),
    R("money", "10.50", "\\$10.50", True),
    R("money", "1000", "\\$1{,}000", True),
    R("money", "\\$1,\\!000.50", "1000.5", True),
    R("money", "\\$12", "\\$10", False),
    R("money", "\\$\\frac{5}{2}", "2.5", True),
    # units
    R("units", "5", "5\\text{ cm}", True),
    R("units", "5\\text{ cm}", "5", True),
    R("units", "5 \\text{ cm}^2", "5\\text{ cm}^2", True),
    R("units", "12 \\text{ inches}", "12", True),
    R("units", "5 \\text{ centimeters}", "5\\text{ cm}", True),
    R("units", "6\\text{ cm}", "5\\text{ cm}", False),
    R("units", "5\\ \\text{cm}", "5", True),
    R("units", "12\\text{ meters}", "12\\text{ m}", True),
    R("units", "5\\text{ m}", "5\\text{ cm}", False),
    # multiple choice
    R("choice", "\\text{(A)}", "\\text{(A)}", True),
    R("choice", "A", "\\text{(A)}", True),
    R("choice", "\\text{(C)}", "C", True),
    R("choice", "(B)", "\\text{(A)}", False),
    R("choice", "\\textbf{(B)}", "\\text{(B)}", True),
    R("choice", "\\mbox{(B)}", "B", True),
    # degrees
    R("degrees", "30", "30^\\circ", True),
    R("degrees", "30^{\\circ}", "30^\\circ", True),
    R("degrees", "30^\\circ", "30", True),
    R("degrees", "60^\\circ", "30^\\circ", False),
    # fractions
    R("fractions", "\\dfrac{1}{2}", "\\frac{1}{2}", True),
    R("fractions", "\\tfrac{3}{4}", "\\dfrac{3}{4}", True),
    R("fractions", "\\frac{2}{4}", "\\frac12", True),
    R("fractions", "1/3", "\\frac{1}{3}", True),
    R("fractions", "-\\frac{1}{2}", "-\\dfrac{1}{2}", True),
    R("fractions", "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
    R("fractions", "\\frac{1}{3}", "\\frac{2}{3}", False),
    R("fractions", "-\\dfrac{\\sqrt{2}}{2}", "-\\frac{\\sqrt2}{2}", True),
    # decimals against fractions
    R("decimals", "0.5", "\\frac{1}{2}", True),
    R("decimals", "2.5", "\\frac{5}{2}", True),
    R("decimals", "0.75", "\\frac34", True),
    R("decimals", "0.33", "\\frac{1}{3}", False),
    # \left \right and intervals
    R("intervals", "\\left( 1, 2 \\right)", "(1,2)", True),
    R("intervals", "\\left[ -2, 3 \\right)", "[-2,3)", True),
    R("intervals", "[1, \\infty)", "[1,\\infty)", True),
    R("intervals", "(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0)\\cup(1,\\infty)", True),
    R("intervals", "(1, \\infty)", "[1,\\infty)", False),
    R("intervals", "x \\in [2, 5]", "[2,5]", True),
    # sets and tuples
    R("sets", "3, 1, 2", "1,2,3", True),
    R("sets", "\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True),
    R("sets", "\\left\\{ 1, 2 \\right\\}", "\\{1,2\\}", True),
    R("sets", "\\{1, 2\\}", "\\{1, 2, 3\\}", False),
    R("tuples", "(2, 3)", "(2,3)", True),
    R("tuples", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    R("tuples", "(3, 2)", "(2,3)", False),
    # negatives
    R("negatives", "-5", "-5", True),
    R("negatives", "\u22125", "-5", True),  # a Unicode minus
    R("negatives", "5", "-5", False),
    # thousands separators
    R("thousands", "1000", "1{,}000", True),
    R("thousands", "10,000", "10000", True),
    R("thousands", "1,\\!000,\\!000", "1000000", True),
    R("thousands", "1,000", "1{,}000", True),
    R("thousands", "1,001", "1{,}000", False),
    # expressions
    R("expressions", "2\\sqrt{2}", "\\sqrt{8}", True),
    R("expressions", "3\\pi", "3\\pi", True),
    R("expressions", "x^2 + 2x + 1", "(x+1)^2", True),
    R("expressions", "x = 3", "3", True),
    R("expressions", "25\\%", "25", True),
    R("expressions", "10\\%", "0.1", True),
    R("expressions", "\\sqrt{2}", "\\sqrt{3}", False),
    R("matrices", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    R("matrices", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
    R("text", "\\text{Evelyn}", "\\text{Evelyn}", True),
    R("text", "\\text{odd}", "\\text{even}", False),
    # \boxed{} extraction from whole responses
    R("boxed", "We get $x = 3$, so the answer is $\\boxed{3}$.", "3", True, full=True),
    R("boxed", "At first I thought $\\boxed{4}$, but checking again it is $\\boxed{5}$.", "5", True, full=True),
    R("boxed", "So $\\boxed{\\frac{\\sqrt{3}}{2}}$ is the value.", "\\frac{\\sqrt{3}}{2}", True, full=True),
    R("boxed", "She pays $\\boxed{\\$18}$ in total.", "18", True, full=True),
    R("boxed", "The area is $\\boxed{12\\text{ cm}^2}$.", "12", True, full=True),
    R("boxed", "The answer is $\\boxed{7}$.", "8", False, full=True),
    R("boxed", "I am not sure how to solve this.", "5", False, full=True),
]

@dataclass(frozen=True)
class Pair:
    family: str
    response: str
    ground_truth: str
    correct: bool
    added: str | None = None  # the streamrl rule expected to call it equal where math-verify does not


P = Pair
#: The forms issue 22 reports, as written there.
ISSUE: list[Pair] = [
    P("thousands", "The final answer is $10,455$.", "10455", True),
    P("thousands", "So the total is $\\boxed{11,\\! 111,\\! 111,\\! 100}$.", "11111111100", True),
    P("thousands", "Hence $\\boxed{32,\\! 349}$.", "32349", True),
    P("boxes", "$\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}$", "1,-2", True),
    P("boxes", "The pairs are $\\boxed{(1, 2)}, \\boxed{(2, 1)}, \\boxed{(3, 4)}$.", "(1, 2), (2, 1), (3, 4)", True),
    P("boxes", "$\\boxed{1},\\boxed{2},\\boxed{3}$", "\\{1,2,3\\}", True),
    P("assignments", "$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$", "k = 45, n = 2", True),
    P("assignments", "The roots are $x_{1}=2, x_{2}=3$.", "2, 3", True),
    P("assignments", "So $x_{1}=\\boxed{2}$, $x_{2}=\\boxed{3}$.", "x_1 = 2, x_2 = 3", True),
    # the same forms with a wrong value
    P("thousands", "The final answer is $10,456$.", "10455", False),
    P("thousands", "So the total is $\\boxed{11,\\! 111,\\! 111,\\! 101}$.", "11111111100", False),
    P("boxes", "$\\boxed{-2} \\quad \\text{and} \\quad \\boxed{3}$", "1,-2", False),
    P("assignments", "$\\boxed{k = 2} \\quad \\text{and} \\quad \\boxed{n = 45}$", "k = 45, n = 2", False),
]

#: A ground truth written in LaTeX, as math-verify's README writes gold (read whole, as well).
LATEX_GOLD: list[Pair] = [
    P("latex gold", "So $\\boxed{-3, 4}$.", "$\\boxed{4}$ and $\\boxed{-3}$", True),
    P("latex gold", "So $\\boxed{-3, 5}$.", "$\\boxed{4}$ and $\\boxed{-3}$", False),
    P("latex gold", "The roots are $\\boxed{\\{2, 7\\}}$.", "\\(\\boxed{7}\\), \\(\\boxed{2}\\)", True),
    P("latex gold", "It is $\\boxed{\\frac{3}{4}}$.", "$0.75$", True),
    P("latex gold", "It is $\\boxed{\\frac{3}{5}}$.", "$0.75$", False),
]

_SEPARATORS = {",": None, "{,}": None, ",\\!": None, ",\\! ": None,
               "\\,": "math_notation", "\\ ": "math_notation", "~": "math_notation"}
_JOINERS = {", ": None, " and ": None, "$ or $": None, " \\quad \\text{and} \\quad ": None,
            "$ \\text{ or } $": "spread_boxes", "$, and then $": "spread_boxes", "$; $": "spread_boxes"}


def _grouped(n: int, sep: str) -> str:
    digits = str(n)
    head = len(digits) % 3 or 3
    groups = [digits[:head]] + [digits[i:i + 3] for i in range(head, len(digits), 3)]
    return sep.join(groups)


def generated(seed: int = 22) -> list[Pair]:
    rng = random.Random(seed)
    pairs: list[Pair] = []
    # numbers with thousands separators: boxed, in a "final answer" sentence, in plain text
    for sep, added in _SEPARATORS.items():
        for _ in range(6):
            n = rng.randrange(1_000, 10_000_000_000)
            wrong = n + rng.choice([1, 9, 1000])
            gt = rng.choice([str(n), _grouped(n, "{,}")])
            for value, ok in ((n, True), (wrong, False)):
                shown = _grouped(value, sep)
                response = rng.choice([f"The total is $\\boxed{{{shown}}}$.",
                                       f"The final answer is ${shown}$."])
                pairs.append(Pair("separators", response, gt, ok, added if ok else None))
        if sep == ",":
            n = rng.randrange(1_000, 1_000_000)
            pairs.append(Pair("separators", f"The answer is {_grouped(n, ',')}.", str(n), True))
            pairs.append(Pair("separators", f"The answer is {_grouped(n + 1, ',')}.", str(n), False))
    # sets: any order, written as a set or a list
    for _ in range(16):
        values = rng.sample(range(-20, 40), 3)
        shuffled = rng.sample(values, 3)
        gt = rng.choice(["\\{{{}\\}}", "{}"]).format(", ".join(map(str, values)))
        shown = rng.choice(["\\{{{}\\}}", "{}"]).format(", ".join(map(str, shuffled)))
        wrong = rng.choice([v for v in range(-20, 40) if v not in values])
        bad = rng.choice(["\\{{{}\\}}", "{}"]).format(", ".join(map(str, shuffled[:2] + [wrong])))
        pairs.append(Pair("sets", f"The solutions are $\\boxed{{{shown}}}$.", gt, True))
        pairs.append(Pair("sets", f"The solutions are $\\boxed{{{bad}}}$.", gt, False))
    # tuples: order matters
    for _ in range(12):
        a, b = rng.sample(range(-9, 30), 2)
        pairs.append(Pair("tuples", f"The point is $\\boxed{{({a}, {b})}}$.", f"({a},{b})", True))
        pairs.append(Pair("tuples", f"The point is $\\boxed{{({b}, {a})}}$.", f"({a},{b})", False))
    # intervals: brackets matter
    for _ in range(12):
        a, b = sorted(rng.sample(range(-20, 20), 2))
        left, right = rng.choice("[("), rng.choice("])")
        other = {"[": "(", "(": "["}[left]
        gt = f"{left}{a},{b}{right}"
        pairs.append(Pair("intervals", f"So $x \\in \\boxed{{{left}{a}, {b}{right}}}$.", gt, True))
        pairs.append(Pair("intervals", f"So $x \\in \\boxed{{{other}{a}, {b}{right}}}$.", gt, False))
    # assignments: names bind values
    for _ in range(10):
        a, b = rng.sample(range(1, 60), 2)
        gt = f"k = {a}, n = {b}"
        for shown, ok in ((f"$\\boxed{{k = {a}}} \\quad \\text{{and}} \\quad \\boxed{{n = {b}}}$", True),
                          (f"$\\boxed{{k = {a}, n = {b}}}$", True),
                          (f"$\\boxed{{n = {b}, k = {a}}}$", True),
                          (f"$\\boxed{{k = {b}, n = {a}}}$", False)):
            pairs.append(Pair("assignments", shown, gt, ok))
        pairs.append(Pair("assignments", f"So $x_{{1}}={a}, x_{{2}}={b}$.", f"{a}, {b}", True))
        pairs.append(Pair("assignments", f"So $x_{{1}}={a}, x_{{2}}={b + 1}$.", f"{a}, {b}", False))
    # an answer over several boxes, whatever stands between them
    for joiner, added in _JOINERS.items():
        for _ in range(4):
            values = rng.sample(range(-9, 30), rng.choice([2, 3]))
            gt = rng.choice(["\\{{{}\\}}", "{}"]).format(", ".join(map(str, values)))
            wrong = rng.choice([v for v in range(-9, 30) if v not in values])
            for shown, ok in ((values, True), (values[:-1] + [wrong], False)):
                boxes = joiner.join(f"\\boxed{{{v}}}" for v in rng.sample(shown, len(shown)))
                pairs.append(Pair("boxes", f"The answers are ${boxes}$.", gt, ok, added if ok else None))
    return pairs


def all_pairs() -> list[Pair]:
    """Every pair the suite holds: the hand-graded table of ``test_math_parity`` (answers written
    the way a model's response carries them), the issue's examples, the generated ones. The
    hand table's additions are marked in ``HAND_ADDED``."""
    hand = [Pair(f"hand:{r.case}", r.response(), r.ground_truth, r.correct, HAND_ADDED.get((r.answer, r.ground_truth)))
            for r in ROWS]
    return hand + ISSUE + LATEX_GOLD + generated()


#: Hand-table rows that math-verify calls different and a streamrl rule calls equal (none: on
#: these 78 rows math-verify is right wherever it answers "equal" but one, the unit veto).
HAND_ADDED: dict[tuple[str, str], str] = {}
#: Rows where math-verify says "equal" and streamrl "different", with the documented rule.
VETOED: dict[tuple[str, str], str] = {("5\\text{ m}", "5\\text{ cm}"): "units"}


def agreement(verdict: Callable[[str, str], bool]) -> dict[str, tuple[int, int]]:
    """How often ``verdict(response, ground_truth)`` matches the expected verdict, per group of
    pairs (a scorer that raises has not agreed)."""
    groups = {"hand": all_pairs()[:len(ROWS)], "issue 22": ISSUE, "LaTeX gold": LATEX_GOLD,
              "generated": generated()}
    out = {}
    for name, pairs in groups.items():
        agree = 0
        for pair in pairs:
            try:
                agree += verdict(pair.response, pair.ground_truth) is pair.correct
            except Exception:  # noqa: BLE001
                pass
        out[name] = (agree, len(pairs))
    return out


# -- the verdicts compared: math-verify itself (the floor), verl's scorers ------------------------

def math_verify_says_equal(response: str, ground_truth: str) -> bool:
    golds = [parse(f"\\boxed{{{ground_truth}}}", [LatexExtractionConfig(), ExprExtractionConfig()])]
    if any(mark in ground_truth for mark in ("$", "\\(", "\\[", "\\boxed")):
        golds.append(parse(ground_truth, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]))
    for configs in ([LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                    [ExprExtractionConfig(), LatexExtractionConfig()]):
        pred = parse(response, configs)
        if pred and any(gold and verify(gold, pred) for gold in golds):
            return True
    return False


def _verl_dir() -> Path | None:
    spec = importlib.util.find_spec("verl")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "utils" / "reward_score"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"streamrl_test_verl_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_scorers() -> dict[str, Callable[[str, str], bool]]:
    """verl's math scorers as ``(response, ground_truth) -> correct``, loaded from their files."""
    where = _verl_dir()
    if where is None:
        return {}
    scorers: dict[str, Callable[[str, str], bool]] = {}
    dapo = _load(where / "math_dapo.py")
    scorers["verl math_dapo"] = lambda resp, gt: bool(dapo.compute_score(resp, gt)["acc"])
    math_file = where / "math_reward.py" if (where / "math_reward.py").exists() else where / "math.py"
    lm_eval = _load(math_file)
    scorers[f"verl {math_file.stem}"] = lambda resp, gt: lm_eval.compute_score(resp, gt) == 1.0
    mv = _load(where / "math_verify.py")
    if hasattr(mv, "_verify_in_subprocess"):
        # verl >= 0.7 runs this in a spawn pool, which can only re-import a module of an installed
        # verl; the pool is transport, this function is the scoring, run here on the main thread
        scorers["verl math_verify"] = lambda resp, gt: mv._verify_in_subprocess(f"\\boxed{{{gt}}}", resp) == 1.0
    else:
        scorers["verl math_verify"] = lambda resp, gt: float(mv.compute_score(resp, gt)) == 1.0
    return scorers


def main(argv: list[str]) -> None:
    """``python -m tests.scorers.math_pairs [OLD_MODULE.py ...]``: agreement with the expected verdicts
    for streamrl's math scorer, verl's ``math_verify`` (if importable) and each named file's
    ``compute_score`` (e.g. an older ``streamrl/scorers/math_verify.py`` from ``git show``)."""
    from streamrl.scorers.math_verify import compute_score

    scorers: dict[str, Callable[[str, str], bool]] = {}
    for path in argv:
        spec = importlib.util.spec_from_file_location(f"math_pairs_{Path(path).stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        scorers[path] = lambda r, g, m=module: m.compute_score("math", r, g)["score"] == 1.0
    verl = verl_scorers().get("verl math_verify")
    if verl is not None:
        scorers["verl math_verify"] = verl
    scorers["streamrl math"] = lambda r, g: compute_score("math", r, g)["score"] == 1.0
    pairs = all_pairs()
    floor = [math_verify_says_equal(p.response, p.ground_truth) for p in pairs]
    scorers = {"math-verify itself": math_verify_says_equal, **scorers}
    for name, verdict in scorers.items():
        counts = agreement(verdict)
        print(f"{name}: " + ", ".join(f"{group} {a}/{n}" for group, (a, n) in counts.items())
              + f", all {sum(a for a, _ in counts.values())}/{sum(n for _, n in counts.values())}")
        lost = 0
        for pair, equal in zip(pairs, floor):
            try:
                lost += equal and verdict(pair.response, pair.ground_truth) is not True
            except Exception:  # noqa: BLE001
                lost += equal
        print(f"    of math-verify's {sum(floor)} 'equal' verdicts, called different: {lost}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
