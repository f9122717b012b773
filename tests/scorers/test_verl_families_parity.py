"""Every non-code family of verl 0.9.1's ``default_compute_score`` against verl's own function,
on generated cases that cover each family's domain (answer formats, fallbacks, normalisation,
wrong answers, ground truths of every JSON type), in both of streamrl's modes:

- verl's mode (the kwargs ``reward.verl_compat`` gives each entry, ``rules.verl_compat``): equal
  to verl wherever verl answers, apart from the differences kept on purpose (``KEPT``), each
  named and counted;
- streamrl's default: the differences are counted (docs/guides/verl.md prints the counts) and
  bounded by what the docs promise (DAPO's default never rejects what verl accepts, ...).

Ours never raises anything but ``Failure`` (a dead letter with its reason), whatever verl does.
verl's modules are loaded from their files (as ``math_pairs`` does): ``verl/__init__`` pulls Ray
and torch, these modules only ``re`` / ``random`` / ``string`` / mathruler. Run with ``-s`` to see
the table.
"""

from __future__ import annotations

import functools
import importlib
import random
import re
import sys
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from streamrl.errors import Failure
from streamrl.reward.config import RewardConfig
from streamrl.reward.table import build_table
from streamrl.scorers import geo3k, gsm8k, math_dapo, math_reward, math_verify, prime_math, search_r1
from streamrl.scorers.rules import MATH_SOURCES, NUMINA_SOURCES, SEARCH_R1_SOURCES
from tests.scorers.math_pairs import _load, _verl_dir

VERL = _verl_dir()
pytestmark = pytest.mark.skipif(VERL is None, reason="verl is not installed (make install puts 0.9.1 in, --no-deps)")

# -- the generated domain ----------------------------------------------------------------------------

#: answers as models and datasets write them: numbers, fractions, LaTeX, units, choices, tuples,
#: intervals, money, percent, degrees, text, empties
ANSWERS = ["42", "-3", "0.5", ".5", "\\frac{1}{2}", "\\frac12", "\\dfrac{3}{4}", "3/4", "1,234", "1234",
           "\\sqrt{2}", "\\sqrt2", "2\\sqrt{3}", "x=5", "k = 3", "5 dollars", "\\text{(A)}", "A", "(1,2)",
           "[1, 2)", "\\left(1,2\\right)", "\\$10", "10\\%", "30^\\circ", "30^{\\circ}", "\\pi", "3.14", "",
           " ", "\\text{ cm}", "7 \\text{ cm}", "\\infty", "\\boxed{7}", "$7$", "7.", "\\text{Paris}", "paris",
           "The Eiffel Tower", "\\frac", "\\sqrt", "4\\text{ m}\\text{ s}", "1{,}000", "1000", "\\{1,2\\}",
           "[INVALID]", "x^2+1", "\\mathrm{th}", "2\\pi", "0", "72.0", "72"]


def _templates(a: str, b: str) -> list[str]:
    """Responses that write ``a`` (and sometimes a second answer ``b``) in every form the
    families read or ignore."""
    return [f"Reasoning.\nAnswer: {a}", f"answer : {a}.", f"So the answer is $\\boxed{{{a}}}$.", f"\\boxed{{{a}}}",
            f"Answer: {a}\nthen more text", f"{'x' * 400}\nAnswer: {a}", f"Answer: {a}\n{'y' * 400}",
            f"\\boxed{{{a}}}{' pad' * 30}", f"\\boxed {a}$ done", f"\\fbox{{{a}}}", f"\\boxed{{{a}", f"#### {a}",
            f"The answer is {a}", f"<think>t</think> \\boxed{{{a}}}", f"Answer: {a}\n\\boxed{{{b}}}",
            f"\\boxed{{{b}}} and \\boxed{{{a}}}", f"<answer>{a}</answer>", f"<answer> {b} </answer><answer>{a}</answer>",
            f"{'<answer>' * 11}{a}</answer>", f"Answer:\n{a}", "", "no answer here"]


#: ground truths of every JSON type, besides the strings of ANSWERS
ODD_TRUTHS: list[Any] = [42, 4.0, 0.5, -3, 10 ** 30, True, False, None, [1, 2], ["Paris"], [], {}, {"target": "x"},
                         {"target": ["Paris", "The Eiffel Tower"]}, {"target": []}, {"other": 1}, "", "  "]


def cases(seed: int, n_truths: int) -> list[tuple[str, Any]]:
    """``(response, ground_truth)``: every template with every answer against that answer (the
    right one), ``n_truths`` other answers (wrong ones, or the same written otherwise) and one
    odd ground truth."""
    rng = random.Random(seed)
    out = []
    for a in ANSWERS:
        for response in _templates(a, rng.choice(ANSWERS)):
            out.append((response, a))
            for truth in rng.sample(ANSWERS, n_truths):
                out.append((response, truth))
            out.append((response, rng.choice(ODD_TRUTHS)))
    return out


# -- verl's functions, and ours in each mode -----------------------------------------------------

@dataclass
class Family:
    name: str
    data_source: str
    verl: Callable[[str, Any], Any]
    ours: dict[str, Callable[[str, Any], dict]]  # mode -> scorer
    cases: list[tuple[str, Any]]
    #: mode -> reason -> does this case differ from verl on purpose for that reason?
    kept: dict[str, dict[str, Callable[[str, Any, Any, Any], bool]]]


def _verl_module(name: str) -> types.ModuleType:
    assert VERL is not None
    return _load(VERL / f"{name}.py")


def _quiet_search_r1() -> types.ModuleType:
    """verl's search-R1 prints one call in 64 at random (and reads ``ground_truth['target']``
    for the print): that draw is made never to print, so a case's verdict does not depend on luck."""
    module = _verl_module("search_r1_like_qa_em")
    module.random = types.SimpleNamespace(randint=lambda a, b: 2)
    return module


#: math-verify's budgets for these tests: verl's functions have none, and a loaded CI machine
#: must not turn a slow comparison into a difference (the budgets have tests of their own)
PATIENT = {"parse_timeout_s": 300.0, "verify_timeout_s": 300.0}


def _verl_prime_math() -> types.ModuleType:
    """verl's ``prime_math`` package imports ``verl.utils.py_functional`` (its time limit), whose
    ``verl`` package would import Ray and torch: the packages above it are put in ``sys.modules``
    as bare namespaces while it loads, and ``sys.modules`` is put back afterwards."""
    assert VERL is not None
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
    try:
        for name, path in (("verl", VERL.parent.parent), ("verl.utils", VERL.parent),
                           ("verl.utils.reward_score", VERL)):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        module = importlib.import_module("verl.utils.reward_score.prime_math")
        # each SymPy comparison in a child process of its own (verl's time limit) costs a fork per
        # call: the comparison itself is called here, as math_pairs calls verl's math_verify
        module.are_equal_under_sympy = module.are_equal_under_sympy.__wrapped__
        return module
    finally:
        for name in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _prime_cases() -> list[tuple[str, Any]]:
    """PRIME's shapes: its answer markers, ``$`` / ``%`` / bases / ``\\pi``, intervals and
    ``Interval(...)``, ``Point``, matrices, unreduced fractions, mixed numbers, millions, SymPy's
    equalities, percent readings, and the odd types."""
    pairs = [("2\\pi", "2\\pi"), ("6.28", "2\\pi"), ("6.283", "2\\pi"), ("\\frac{\\pi}{2}", "\\frac{\\pi}{2}"),
             ("$5", "5"), ("$5.50", "5.5"), ("50%", "50"), ("50\\%", "0.5"), ("5_8", "5"), ("x_1", "5"),
             ("Interval(0, 1)", "[0, 1]"), ("Interval.open(0, 1)", "(0,1)"), ("Interval.Ropen(0, 1)", "[0,1)"),
             ("[0, 1]", "[0,1]"), ("(0, 1]", "(0,1]"), ("(1, 2)", "(1,2)"), ("Point(1, 2)", "(1, 2)"),
             ("Point(1, 3)", "(1, 2)"), ("Matrix([[1], [2]])", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
             ("[[1],[2]]", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"), ("[a]", "\\begin{pmatrix} 1 \\end{pmatrix}"),
             ("2/4", "1/2"), ("1/2", "1/2"), ("0.5", "\\frac{1}{2}"), ("7 3/4", "7.75"), ("1,000", "1000"),
             ("10 million", "10000000"), ("\\text{5 cm}", "5"), ("3 and 4", "3, 4"), ("x^2 + 2x", "x(x+2)"),
             ("\\sqrt{8}", "2\\sqrt{2}"), ("1", "100"), ("100", "1"), ("2x+1", "1+2x"), ("\\infty", "\\infty"),
             ("9^9^9", "1"), ("2^{10}", "1024"), ("1e400", "inf"), ("nan", "nan"), ("\\{1,2\\}", "\\{2,1\\}"),
             ("-3", "- 3"), ("\\dfrac{3}{4}", "0.75"), ("30^\\circ", "30"), ("x=5", "5"), ("A", "a"), ("", "5")]
    out = []
    for given, truth in pairs:
        for response in (f"The answer is {given}", f"Step 1: ...\nStep 2: so \\boxed{{{given}}}.",
                         f"We get {given}. Done", f"{given} is the answer", f"answer: {given}\nbecause x = 3",
                         f"so x = \\boxed{{{given}}}", given):
            out.append((response, truth))
    return out + _sample(cases(5, 1), 150, seed=5)


def _not_string(response: str, truth: Any, verl: Any, ours: Any) -> bool:
    return not isinstance(truth, str)


def _families() -> list[Family]:
    v_gsm8k = _verl_module("gsm8k")
    v_math = _verl_module("math_reward")
    v_dapo = _verl_module("math_dapo")
    v_geo = _verl_module("geo3k")
    v_search = _quiet_search_r1()
    v_prime = _verl_prime_math()

    def solution_truth(response: str, truth: Any, verl: Any, ours: Any) -> bool:
        # a whole GSM8K solution as ground truth is read to its "#### N" number (verl_ground_truth)
        return isinstance(truth, str) and "#### " in truth

    def empty_truth(response: str, truth: Any, verl: Any, ours: Any) -> bool:
        return isinstance(truth, str) and isinstance(ours, Failure) and ours.reason == "bad_ground_truth" \
            and _strips_empty(truth)

    def number_truth(response: str, truth: Any, verl: Any, ours: Any) -> bool:
        return isinstance(truth, (int, float)) and not isinstance(truth, bool)

    def search_shapes(response: str, truth: Any, verl: Any, ours: Any) -> bool:
        # null, no target, an empty list: refused whatever the response (verl: 0 or the format score)
        return isinstance(ours, Failure) and not _usable_target(truth)

    return [
        Family("gsm8k", "openai/gsm8k", v_gsm8k.compute_score,
               {"verl": lambda r, t: gsm8k.compute_score("openai/gsm8k", r, t, method="strict",
                                                         format_score=0.0, score=1.0),
                "default": lambda r, t: gsm8k.compute_score("openai/gsm8k", r, t)},
               cases(1, 3) + _gsm8k_cases(),
               {"verl": {"not a string (verl: a constant score)": _not_string,
                         "a whole solution as ground truth": solution_truth}}),
        Family("math_reward", "lighteval/MATH", v_math.compute_score,
               {"verl": lambda r, t: math_verify.compute_score("lighteval/MATH", r, t, method="verl"),
                "default": lambda r, t: math_verify.compute_score("lighteval/MATH", r, t, **PATIENT)},
               cases(2, 2),
               {"verl": {"not a string (verl: a constant 0)": _not_string,
                         "an empty ground truth (verl: 1.0 for an empty box)": empty_truth}}),
        Family("math_dapo", "math_dapo", v_dapo.compute_score,
               {"verl": lambda r, t: math_dapo.compute_score("math_dapo", r, t, method="verl"),
                "default": lambda r, t: math_dapo.compute_score("math_dapo", r, t, **PATIENT)},
               cases(3, 3), {"verl": {}}),
        Family("geo3k", "hiyouga/geometry3k", v_geo.compute_score,
               {"verl": lambda r, t: geo3k.compute_score("hiyouga/geometry3k", r, t)},
               _sample(cases(4, 1), 400, seed=4),
               {"verl": {"null ground truth (verl: format score only)": lambda r, t, v, o: t is None}}),
        Family("prime_math", "numina_olympiads", lambda r, t: v_prime.compute_score(r, t)[0],
               {"verl": lambda r, t: prime_math.compute_score("numina_olympiads", r, t)},
               _prime_cases(),
               {"verl": {"null or a non-answer type (verl: its Python str())": lambda r, t, v, o: isinstance(o, Failure)
                         and (t is None or isinstance(t, (bool, list, dict)))}}),
        Family("search_r1", "searchR1_nq", v_search.compute_score,
               {"verl": lambda r, t: search_r1.compute_score("searchR1_nq", r, t)},
               _search_cases(),
               {"verl": {"no usable target (verl: 0 without an answer tag)": search_shapes}}),
    ]


def _usable_target(truth: Any) -> bool:
    if isinstance(truth, dict):
        return _usable_target(truth.get("target"))
    if isinstance(truth, list):
        return bool(truth) and all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in truth)
    return isinstance(truth, str)


def _strips_empty(truth: str) -> bool:
    try:
        return math_reward.strip(truth) == ""
    except Exception:  # noqa: BLE001
        return False


def _sample(items: list, n: int, seed: int) -> list:
    return random.Random(seed).sample(items, min(n, len(items)))


def _gsm8k_cases() -> list[tuple[str, Any]]:
    """GSM8K's own shapes: ``#### N`` with commas, dollars, decimals, negatives, the 300-char tail."""
    out = []
    for n in ("18", "1,234", "-7", "3.5", "0", "$5", "10.", "1.2.3"):
        for response in (f"#### {n}", f"work\n#### {n}", f"####{n}", f"#### {n}\n#### 99", f"#### {n}" + " z" * 200,
                         f"so {n} apples", f"It is {n}."):
            for truth in (n.replace(",", "").replace("$", ""), "18", f"x <<1+1=2>>\n#### {n}", n):
                out.append((response, truth))
    return out


def _search_cases() -> list[tuple[str, Any]]:
    """Search-R1's shapes: targets as a string, a list, JSON text (what the feed writes), articles
    and punctuation, the tag guard, bare strings and lists (verl raises), the odd types."""
    out = []
    truths: list[Any] = [{"target": "Paris"}, {"target": ["Paris", "City of Light"]}, {"target": ["the Beatles"]},
                         {"target": "U.S.A."}, '{"target": ["Paris"]}', "Paris", ["Paris"], {"target": [42]},
                         {"target": "42"}, *ODD_TRUTHS]
    for a in ("Paris", "paris!", "The Paris", "the beatles", "Beatles", "usa", "U.S.A", "City  of light", "42",
              "London", "", "an apple"):
        for response in (f"<answer>{a}</answer>", f"<answer>\n{a}\n</answer>", f"<answer>x</answer> <answer>{a}</answer>",
                         f"{'<answer>' * 11}{a}</answer>", f"{a}</answer>" * 11, f"<answer>{a}", f"<search>q</search> {a}"):
            for truth in truths:
                out.append((response, truth))
    return out


# -- the comparison ------------------------------------------------------------------------------------

def _run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - verl's raising is an outcome; ours is checked below
        return exc


def _same(verl: Any, ours: dict) -> bool:
    if isinstance(verl, dict):
        return all(ours.get(k) == v for k, v in verl.items())
    return float(verl) == ours["score"]


def compare(family: Family, mode: str) -> tuple[Counter, list[str], list[tuple[Any, Any, Any]]]:
    """Counts per outcome (``equal``, ``different``, ``refused: REASON``, ``verl raises``,
    ``kept: REASON``), the
    differences nobody kept on purpose, and every ``(ground truth, verl's, ours)``."""
    counts: Counter = Counter()
    unexplained: list[str] = []
    seen: list[tuple[Any, Any, Any]] = []
    ours_fn = family.ours[mode]
    kept = family.kept.get(mode)
    for response, truth in family.cases if mode == "verl" else default_cases(family):
        verl = _run(lambda: family.verl(response, truth))
        ours = _run(lambda: ours_fn(response, truth))
        assert not isinstance(ours, Exception) or isinstance(ours, Failure), \
            f"{family.name}/{mode} raised {ours!r} on {response[:60]!r} / {truth!r}"
        seen.append((truth, verl, ours))
        if isinstance(verl, Exception):
            counts["verl raises"] += 1
            continue
        if not isinstance(ours, Failure) and _same(verl, ours):
            counts["equal"] += 1
            continue
        reason = next((name for name, why in (kept or {}).items() if why(response, truth, verl, ours)), None)
        if reason is not None:
            counts[f"kept: {reason}"] += 1
        else:
            counts[f"refused: {ours.reason}" if isinstance(ours, Failure) else "different"] += 1
            if kept is not None:  # verl's mode: every difference must be kept on purpose
                unexplained.append(f"{response[:60]!r} / {truth!r}: verl {verl!r}, ours {ours!r}")
    return counts, unexplained, seen


def default_cases(family: Family) -> list[tuple[str, Any]]:
    """streamrl's default asks math-verify (milliseconds a case) where verl's strings differ: a
    fixed sample of the family's domain keeps the test to seconds."""
    return _sample(family.cases, DEFAULT_SAMPLE, seed=len(family.name))


DEFAULT_SAMPLE = 250
#: the families, and those with a streamrl default of their own (the others have one mode)
NAMES = ("gsm8k", "math_reward", "math_dapo", "geo3k", "prime_math", "search_r1")
TWO_MODES = ("gsm8k", "math_reward", "math_dapo")


@functools.lru_cache(maxsize=1)
def _all_families() -> dict[str, Family]:
    """Built on first use, not at collection: every xdist worker collects this file."""
    return {f.name: f for f in _families()}


@pytest.mark.parametrize("name", NAMES)
def test_verl_mode_equals_verl_wherever_verl_answers(name: str, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prime_math, "SYMPY_TIMEOUT_S", 300.0)  # verl's, as called here, has none (PATIENT)
    family = _all_families()[name]
    counts, unexplained, _ = compare(family, "verl")
    with capsys.disabled():
        print(f"\n{family.name} ({family.data_source}) verl mode: {dict(counts)}")
    assert unexplained == [], f"{len(unexplained)} differences from verl:\n" + "\n".join(unexplained[:20])
    # most of the domain is where verl answers, and there ours is verl's
    assert counts["equal"] >= 0.6 * (len(family.cases) - counts["verl raises"])


@pytest.mark.parametrize("name", TWO_MODES)
def test_default_mode_differences_are_counted_and_bounded(name: str, capsys: pytest.CaptureFixture[str]):
    family = _all_families()[name]
    assert "default" in family.ours
    counts, _, seen = compare(family, "default")
    with capsys.disabled():
        print(f"\n{family.name} ({family.data_source}) streamrl default: {dict(counts)}")
    assert counts["equal"] > 0
    if family.name == "math_dapo":  # verl's verdict, plus math-verify's equivalences: never fewer
        answered = [(verl, ours) for _, verl, ours in seen if isinstance(verl, dict) and isinstance(ours, dict)]
        assert answered and all(ours["pred"] == verl["pred"] for verl, ours in answered)
        assert all(ours["acc"] or not verl["acc"] for verl, ours in answered)
        assert counts["different"] == sum(ours["acc"] and not verl["acc"] for verl, ours in answered)


# -- what the families promise beyond parity ---------------------------------------------------------

def test_dapo_falls_back_to_the_last_box_and_normalises_pred():
    """The issue's cases: a boxed answer with no ``Answer:`` line scores +1 (it was -1), and pred
    is normalised as verl's."""
    for method in ("verl", "math_verify"):
        boxed = math_dapo.compute_score("aime24", "so the total is \\boxed{17}", "17", method=method, **PATIENT)
        assert boxed == {"score": 1.0, "acc": True, "pred": "17"}
        line = math_dapo.compute_score("math_dapo", "Answer: $1,000$ dollars.", "1000", method=method, **PATIENT)
        assert line["pred"] == "1000" and line["acc"] is True
    assert math_dapo.compute_score("math_dapo", "Answer: 0.5", "\\frac{1}{2}", method="verl")["acc"] is False
    assert math_dapo.compute_score("math_dapo", "Answer: 0.5", "\\frac{1}{2}", **PATIENT)["acc"] is True  # math-verify adds


ALL_ODD = ODD_TRUTHS + [float("nan"), float("inf"), 10 ** 5000, object()]


@pytest.mark.parametrize("truth", ALL_ODD, ids=[f"{type(t).__name__}{i}" for i, t in enumerate(ALL_ODD)])
@pytest.mark.parametrize("scorer", [
    lambda t: gsm8k.compute_score("openai/gsm8k", "#### 42", t),
    lambda t: gsm8k.compute_score("openai/gsm8k", "#### 42", t, method="strict"),
    lambda t: math_verify.compute_score("lighteval/MATH", "\\boxed{42}", t, **PATIENT),
    lambda t: math_verify.compute_score("lighteval/MATH", "\\boxed{42}", t, method="verl"),
    lambda t: math_dapo.compute_score("aime24", "Answer: 43", t, **PATIENT),
    lambda t: math_dapo.compute_score("aime24", "Answer: 42", t, method="verl"),
    lambda t: geo3k.compute_score("hiyouga/geometry3k", "\\boxed{42}", t),
    lambda t: search_r1.compute_score("searchR1_nq", "<answer>42</answer>", t),
    lambda t: prime_math.compute_score("numina_cn_k12", "The answer is 42", t),
], ids=["gsm8k", "gsm8k-verl", "math", "math-verl", "dapo", "dapo-verl", "geo3k", "search_r1", "prime_math"])
def test_no_ground_truth_makes_a_scorer_raise_anything_but_a_failure(scorer: Callable[[Any], dict], truth: Any):
    try:
        out = scorer(truth)
    except Failure as exc:
        assert exc.reason in ("no_ground_truth", "bad_ground_truth") and exc.detail
        return
    assert isinstance(out["score"], float)


def test_an_integer_ground_truth_reads_as_its_number_by_default():
    """The issue's TypeError: parquet files carry integer answers."""
    assert gsm8k.compute_score("openai/gsm8k", "The answer is 42.", 42)["score"] == 1.0
    assert math_dapo.compute_score("aime24", "Answer: 42", 42)["acc"] is True
    assert math_verify.compute_score("lighteval/MATH", "\\boxed{0.5}", 0.5, **PATIENT)["score"] == 1.0
    with pytest.raises(Failure) as err:  # verl's strict gsm8k compares strings: 42 never equals "42" there
        gsm8k.compute_score("openai/gsm8k", "#### 42", 42, method="strict")
    assert err.value.reason == "bad_ground_truth" and "as strings" in err.value.detail


def test_the_verl_mode_table_scores_each_family_as_verl():
    """Through the reward table's own entries: ``verl_compat`` gives each family verl's method."""
    compat = build_table(RewardConfig(verl_compat=True, process_workers=1))
    default = build_table(RewardConfig(process_workers=1))
    for ds in MATH_SOURCES:
        assert compat.lookup(ds).scorer.kwargs == {"method": "verl"} and default.lookup(ds).name == "math"
    for ds in (*SEARCH_R1_SOURCES, *NUMINA_SOURCES, "hiyouga/geometry3k"):
        assert compat.lookup(ds).name == default.lookup(ds).name
    for ds in ("math", "aime2025", "math_dapo_reasoning"):
        assert compat.lookup(ds).name == "math_dapo" and compat.lookup(ds).scorer.kwargs["method"] == "verl"


def test_every_non_code_data_source_verl_routes_has_a_rule_here():
    """Read from verl's own ``default_compute_score``: every data source it names (and the
    ``aime`` prefix) is routed to a built-in rule in both modes (the code families to ``code``,
    tested in tests/sandbox), and the families tested above are the ones those rules are."""
    assert VERL is not None
    source = (VERL / "__init__.py").read_text()
    body = source[source.index("def default_compute_score"):source.index("@deprecated")]
    named = set(re.findall(r'"([A-Za-z0-9_/\-.]+)"', body.split('"""')[2]))  # past the docstring
    code = {"codecontests", "apps", "codeforces", "taco"}
    assert code <= named and {"openai/gsm8k", "hiyouga/geometry3k", "numina_olympiads", "searchR1_nq"} <= named
    assert 'startswith("aime")' in body
    tables = [build_table(RewardConfig(process_workers=1)), build_table(RewardConfig(verl_compat=True, process_workers=1))]
    for table in tables:
        for ds in sorted(named - code - {"aime"}) + ["aime24", "aime_2025"]:
            entry = table.lookup(ds)
            assert entry is not None and entry.name != "code", ds
        assert {table.lookup(ds).name for ds in code} == {"code"}
    assert set(NAMES) == {"gsm8k", "math_reward", "math_dapo", "geo3k", "prime_math", "search_r1"}


def test_prime_math_never_runs_what_a_response_wrote(tmp_path, monkeypatch: pytest.MonkeyPatch):
    r"""verl's prime_math hands an answer with ``\pi`` to Python's ``eval`` (and a ``Matrix(...)``
    or ``[[...]]`` against a matrix to ``parse_expr`` / ``eval``): the first answer writes the file
    in verl 0.9.1 (tried by hand; the others reach its other two calls). Here they are text that is
    not evaluable, graded wrong, and nothing runs."""
    monkeypatch.chdir(tmp_path)  # a relative name: verl reads a text with "_" as a base (5_8) first
    payloads = ["\\boxed{open('ran','w').write('x')*\\pi}",
                "\\boxed{Matrix([open('ran','w').write('x')])}",
                "\\boxed{[open('ran','w').write('x')]}",
                "\\boxed{Matrix([__import__('os').system('touch ran')])}"]
    truths = ["2\\pi", "\\begin{pmatrix} 1 \\end{pmatrix}", "\\begin{pmatrix} 1 \\end{pmatrix}",
              "\\begin{pmatrix} 1 \\end{pmatrix}"]
    for response, truth in zip(payloads, truths):
        assert prime_math.compute_score("numina_olympiads", response, truth)["score"] == 0.0
    assert not (tmp_path / "ran").exists()
    assert prime_math.compute_score("numina_olympiads", "\\boxed{2\\pi}", "6.2832")["score"] == 1.0  # arithmetic still is


def test_geo3k_gives_sympy_a_time_limit(monkeypatch: pytest.MonkeyPatch):
    """mathruler hands a boxed answer to SymPy, which evaluates it: ``9**9**9`` against a
    non-integer truth never returns (verl's call holds its worker for good). Here the comparison
    has prime_math's per-comparison limit (cut to 1 s for the test): past it, wrong; a plain
    answer is still graded as verl grades it."""
    monkeypatch.setattr(geo3k, "SYMPY_TIMEOUT_S", 1.0)
    assert geo3k.compute_score("hiyouga/geometry3k", "\\boxed{9**9**9}", "2.5")["acc"] is False
    assert geo3k.compute_score("hiyouga/geometry3k", "<think>x</think> \\boxed{5/2}", "2.5")["score"] == 1.0
