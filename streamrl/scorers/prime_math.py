"""PRIME's math reward for the NuminaMath data sources (``numina_aops_forum``,
``numina_synthetic_math``, ``numina_amc_aime``, ``numina_synthetic_amc``, ``numina_cn_k12``,
``numina_olympiads``), as verl 0.9.1's ``prime_math`` scores them: 1.0 or 0.0.

Reading the answer (``match_answer``): the text after the last "answer:" / "answer is" /
"answers are", before the last "is answer" / "is the answer" / ..., the contents of the last
``\\boxed{}`` (or ``\\fbox{}``) of that, cut before its last ". ", then after the last "be ",
"is ", "=", ": ", "get " (and their line-break forms), each in turn.

Grading, as verl: first PRM800K's grader (``grade_answer``: equal after MATH's normalisation, or
after PRM800K's (``\\text{}``, money, percent, units, ``million``, LaTeX to text with pylatexenc,
mixed numbers, case), or element by element of a tuple / interval where SymPy simplifies the
difference to 0, unreduced fractions and integers compared strictly); then ToRA's ``math_equal``:
``$5`` / ``5%`` / ``5_8`` (a base) / ``\\pi`` (as 3.14159... and as 3.14) written out, equal as
strings, as numbers within 1e-4 relative (also a hundredth or a hundred times the reference:
percent), intervals and tuples part by part, ``Point(...)`` against a tuple, a matrix against
``\\begin{pmatrix}``. Any error on the way grades the answer wrong, as in verl.

Where this differs from verl's code, on purpose:

- verl evaluates text from the response with Python's ``eval`` (after writing ``\\pi`` out, and
  for a matrix written ``[[...]]``) and SymPy's ``parse_expr`` (for ``Matrix(...)``), which runs
  whatever the policy wrote. Here nothing from a response is ever evaluated: numbers, arithmetic,
  tuples and lists are computed by a small evaluator (``_evaluate``), anything else (names, calls,
  attributes) is "not evaluable", where verl's ``eval`` could still compute it; a ``Matrix(...)``
  is parsed only without quotes, underscores or attribute access, with SymPy's names alone.
- verl's last step, ``symbolic_equal``, never succeeds in 0.9.1 (its time limit is a decorator
  used as a ``with`` block, which raises inside each attempt's ``try``): it is not run here either.
- verl runs each SymPy comparison in a child process with 10 s; here it runs in-process within the
  same budget (``math_verify``'s bounded calls), running out grading the element wrong, as there.
- A ground truth of null is ``no_ground_truth`` and a bool, list or object ``bad_ground_truth``
  (verl grades against their Python ``str()``: ``"None"``, ``"[1, 2]"``); a number reads as its
  ``str()``, as in verl.
"""

from __future__ import annotations

import ast
import math
import operator
import logging
import re
from typing import Any

from streamrl.errors import Failure
from streamrl.scorers import math_reward
from streamrl.scorers.base import ScoreError

#: pylatexenc warns on every macro it cannot write as text (``\\frac`` with a missing argument):
#: model output is full of them, and the text is used as it came out either way
logging.getLogger("pylatexenc").setLevel(logging.ERROR)

VERSION = "1"
SYMPY_TIMEOUT_S = 10.0  # verl's per comparison

# -- reading the answer -----------------------------------------------------------------------------

_AFTER = ("answer:", "answer is", "answers are")
_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")
_LAST = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def last_box(text: str) -> str | None:
    """The stripped contents of the last ``\\boxed`` (else ``\\fbox``): from the first ``{``
    after it to its matching ``}``; None without one."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, opened = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            opened = i if opened is None else opened
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[opened + 1:i].strip() if opened is not None else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """``(matched, answer)``: see the module docstring. ``matched`` needs a digit in the answer."""
    matched = False
    for marker in _AFTER:
        at = response.lower().rfind(marker)
        if at != -1:
            matched, response = True, response[at + len(marker):].strip()
    for marker in _BEFORE:
        at = response.lower().rfind(marker)
        if at != -1:
            matched, response = True, response[:at].strip()
    boxed = last_box(response)
    if boxed:
        matched, response = True, boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    for marker in _LAST:
        at = response.lower().rfind(marker)
        if at != -1:
            matched, response = True, response[at + len(marker):].strip()
    return matched and any(c.isdigit() for c in response), response


# -- PRM800K's grader -----------------------------------------------------------------------------------

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard", "liter")
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_CIRC = re.compile(r"\^ *\\circ")
_THIN_COMMA = re.compile(r",\\! *")
_MINUS = re.compile(r"- *")
_MIXED = re.compile(r"([0-9]) +([0-9])")
_GROUPED = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


def mathd_normalize(answer: str) -> str:
    """MATH's normalisation after ``\\text{}`` is unwrapped; the stripped text where it fails."""
    answer = answer.strip()
    m = _TEXT.search(answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return math_reward.strip(answer)
    except math_reward.Unnormalisable:
        return answer


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _near_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _strip_grouping_commas(expr: str) -> str:
    while True:
        stripped = _GROUPED.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    value = _float(_strip_grouping_commas(text))
    return value is not None and _near_int(value)


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in _LATEX_SYMBOLS:
        expr = expr.replace(old, new)
    return expr.strip()


def prm_normalize(expr: str) -> str:
    """PRM800K's normalisation of an answer (see the module docstring)."""
    m = _TEXT.search(expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = _CIRC.sub("", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = _THIN_COMMA.sub("", expr)
    value = _float(expr)
    if value is not None and _near_int(value):
        expr = str(int(round(value)))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # noqa: BLE001 - as verl: LaTeX that does not convert stays as it is
            pass
    expr = _MIXED.sub(r"\1+\2", _MINUS.sub("-", expr)).lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _allows_sympy(expr: str) -> bool:
    """PRM800K's guard: at most two distinct letters (``sqrt`` / ``frac`` aside), no ``^{`` /
    ``^(`` / stacked or multi-digit exponents. It also keeps SymPy's parser from ever seeing a
    name long enough to reach Python."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return len(letters) <= 2 and not any(s in expr for s in _BAD_SUBSTRINGS) \
        and not any(r.search(expr) for r in _BAD_REGEXES)


def _sympy_equal(truth: str, given: str) -> bool:
    """SymPy simplifies ``(truth)-(given)`` to 0, within ``SYMPY_TIMEOUT_S``; wrong otherwise."""
    expr = f"({truth})-({given})"
    if not _allows_sympy(expr):
        return False
    from streamrl.scorers.math_verify import _bounded, _Deadline

    def call() -> bool:
        import sympy
        from sympy.parsing import sympy_parser

        try:
            parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=(
                sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)))
            return sympy.simplify(parsed) == 0
        except Exception:  # noqa: BLE001 - as verl: what SymPy cannot read or simplify is not equal
            return False

    try:
        return _bounded(call, _Deadline(SYMPY_TIMEOUT_S, "comparison"))
    except Failure:
        return False  # verl's time limit: the element is graded wrong


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_grouping_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS \
            and not any(c in expr[1:-1] for c in _TUPLE_CHARS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: str, truth: str) -> bool:
    """PRM800K's grader (see the module docstring)."""
    if mathd_normalize(truth) == mathd_normalize(given):
        return True
    truth_n, given_n = prm_normalize(truth), prm_normalize(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = _split_tuple(truth_n), _split_tuple(given_n)
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]) \
            or len(truth_elems) != len(given_elems):
        return False
    for t, g in zip(truth_elems, given_elems):
        if _FRACTION.search(t) and _FRACTION.search(g):
            ok = t == g  # an unreduced fraction is not the reduced one
        elif _str_is_int(t) != _str_is_int(g):
            ok = False  # an integer answer must match strictly
        else:
            ok = _sympy_equal(t, g)
        if not ok:
            return False
    return True


# -- ToRA's math_equal -------------------------------------------------------------------------------

class _Abort(Exception):
    """Where verl's ``math_equal`` raises: the whole answer grades wrong."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Not: operator.not_}
_MAX_INT_BITS = 4096  # a bigger integer (9**9**9) is not a number anyone wrote as an answer


def _evaluate(text: str) -> Any:
    """Python's value of ``text`` where it is literals, arithmetic, tuples and lists; ``ValueError``
    for anything else (names, calls, attributes: never run) and for huge powers and shifts."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an expression") from None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [value(e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(left, int) and isinstance(right, int) and right > 0 and (
                    isinstance(node.op, ast.Pow) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_INT_BITS
                    or isinstance(node.op, ast.LShift) and left != 0 and right > _MAX_INT_BITS):
                raise ValueError("too large")
            if isinstance(node.op, ast.Mult) and isinstance(right, int) and isinstance(left, (str, list, tuple)) \
                    or isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                raise ValueError("sequence repetition")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, int) and result.bit_length() > 64 * _MAX_INT_BITS:
                raise ValueError("too large")  # products of products: bounded all the same
            return result
        raise ValueError(f"{type(node).__name__} is not evaluated")

    try:
        return value(tree.body)
    except (ArithmeticError, TypeError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(str(exc)) from None


def _is_number(s: Any) -> tuple[bool, float | None]:
    text = str(s)
    try:
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _write_out(answer: Any, pi: float) -> Any:
    """ToRA's ``normalize``: ``$5`` -> ``5``, ``5%`` -> ``5``, a base ``5_8`` -> 5, ``\\pi``
    written out and the result computed where it is arithmetic."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        try:
            return int(float(answer.split("_")[0]))
        except (ValueError, OverflowError):
            raise _Abort("not a number in a base") from None
    if isinstance(answer, str) and "\\pi" in answer:
        at = answer.find("\\pi")
        while at != -1:
            factor = f"*{pi}" if at > 0 and answer[at - 1].isdigit() else f"1*{pi}"
            answer = answer[:at] + factor + answer[at + 3:]
            at = answer.find("\\pi", at + 1)
        try:
            answer = _evaluate(answer)
        except ValueError:
            pass
    return answer


def _intervals(prediction: str) -> str:
    for pattern, left, right in ((r"^Interval\((.*)\)$", "[", "]"), (r"^Interval\.Ropen\((.*)\)$", "[", ")"),
                                 (r"^Interval\.Lopen\((.*)\)$", "(", "]"), (r"^Interval\.open\((.*)\)$", "(", ")")):
        m = re.match(pattern, prediction)
        if m:
            return f"{left}{m.group(1)}{right}"
    return prediction


def _parse_matrix(text: str) -> Any:
    """SymPy's reading of ``Matrix(...)`` with SymPy's names only, refused (``_Abort``'s caller
    treats it as no match) where the text could reach Python: quotes, underscores, attributes."""
    if re.search(r"['\"_]|\.\s*[A-Za-z]", text):
        raise ValueError("not a plain matrix")
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    names: dict[str, Any] = {name: getattr(sympy, name) for name in sympy.__all__}
    names.update(__builtins__={}, max=sympy.Max, min=sympy.Min)
    return parse_expr(text, global_dict=names)


def math_equal(prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """ToRA's equality (see the module docstring); ``_Abort`` where verl's raises."""
    prediction, reference = _write_out(prediction, pi), _write_out(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower() \
                or prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    (p_num, p_value), (r_num, r_value) = _is_number(prediction), _is_number(reference)
    if p_num and r_num:
        candidates = [r_value / 100, r_value, r_value * 100] if include_percentage else [r_value]
        return any(math.isclose(c, p_value, rel_tol=tolerance) for c in candidates)
    try:
        if not prediction and prediction not in [0, False]:
            return False
    except Exception as exc:  # noqa: BLE001 - a value without a truth value (an array, a Matrix)
        raise _Abort(str(exc)) from None
    reference, prediction = str(reference).strip(), _intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or \
            (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for bracket in "{}()":
        ref_str, pred_str = ref_str.replace(bracket, ""), pred_str.replace(bracket, "")
    if pred_str == ref_str:
        return True
    if prediction and reference and prediction[0] in "([" and prediction[-1] in ")]" \
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]:
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and all(
                [math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)]):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [p.strip() for p in prediction.split(",")]
        ref_parts = [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)])
    if prediction.startswith("Point"):
        if not reference:
            raise _Abort("an empty reference")
        if reference[0] == "(" and reference[-1] == ")":
            pred_parts = prediction[prediction.find("(") + 1:-1].split(",")
            ref_parts = reference[1:-1].split(",")
            if len(pred_parts) == len(ref_parts) and all(
                    [math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)]):
                return True
    if "\\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:
            matrix = _parse_matrix(prediction)
            items = reference.split()[1:-1:2]
            if len(matrix) == len(items) and all(
                    [math_equal(p, r, include_percentage, tolerance) for r, p in zip(items, matrix)]):
                return True
        except Exception:  # noqa: BLE001 - as verl: a matrix that does not read is no match
            pass
    elif "\\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        try:
            rows = _evaluate(prediction)
        except ValueError:
            raise _Abort("not a literal list") from None  # verl's eval raises outside its try
        if isinstance(rows, list):
            try:
                body = reference.removeprefix("\\\\begin{pmatrix}").removeprefix("\\begin{pmatrix}") \
                    .removesuffix("\\\\end{pmatrix}").removesuffix("\\end{pmatrix}")
                ref_rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
                if len(rows) == len(ref_rows) and all(
                        [math_equal(p, r, include_percentage, tolerance) for r, p in zip(ref_rows, rows)]):
                    return True
            except Exception:  # noqa: BLE001 - as verl
                pass
    return False  # verl's symbolic_equal: never true in 0.9.1 (see the module docstring)


# -- the scorer -------------------------------------------------------------------------------------------

def _truth(ground_truth: Any, data_source: str) -> str:
    if isinstance(ground_truth, str):
        return ground_truth
    if ground_truth is None:
        raise ScoreError("no_ground_truth", f"data_source {data_source!r}: the record has no ground_truth")
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        try:
            return str(ground_truth)  # as verl: str(17), str(2.0), str(nan)
        except ValueError:
            pass
    raise ScoreError("bad_ground_truth", f"data_source {data_source!r}: a ground_truth of type "
                                         f"{type(ground_truth).__name__} is not an answer")


def correct(solution_str: str, truth: str) -> tuple[bool, str]:
    """verl's verdict and the answer read."""
    _, answer = match_answer(solution_str)
    if grade_answer(answer, truth):
        return True, answer
    try:
        if "\\pi" in answer or "\\pi" in truth:
            return any([math_equal(answer, truth, pi=pi) for pi in (math.pi, 3.14)]), answer
        return math_equal(answer, truth), answer
    except Exception:  # noqa: BLE001 - as verl: any error on the way grades the answer wrong
        return False, answer


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``{"score": 1.0 | 0.0, "acc", "format", "pred"}``: ``format`` is verl's format check
    ("Step 2:" and a box in the response), which verl computes and does not score."""
    ok, pred = correct(str(solution_str), _truth(ground_truth, data_source))
    return {"score": float(ok), "acc": ok, "format": "Step 2:" in solution_str and "\\box" in solution_str,
            "pred": pred}
