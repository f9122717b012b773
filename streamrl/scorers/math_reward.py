"""verl's MATH rule (``math_reward``: lm-evaluation-harness's Hendrycks MATH check), for
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500`` in
verl's mode. streamrl's default for them is the ``math`` rule (``math_verify``), which this is not.

The answer is the last box of the whole response: ``\\boxed ANSWER`` (a space, up to the next
``$``) wherever one is written, else the last ``\\boxed{...}`` with balanced braces. A last box
that is not ``\\boxed{`` (an ``\\fbox{}``, ``\\boxed5{}``) or never closes is no answer. The box
and the ground truth are compared as strings after MATH's normalisation (``strip``: line breaks,
``\\!``, ``\\left`` / ``\\right``, degrees, ``\\$``, a right-hand unit after ``\\text{ ``, percent
signs, leading zeros of decimals, a short ``k =`` prefix, ``\\sqrt3`` / ``\\frac12`` / ``a/b``
written out, spaces, ``0.5`` as ``\\frac{1}{2}``); where the normalisation itself fails (two
``\\text{ `` units, a dangling ``\\sqrt``), the raw strings are compared, as in verl.

One deliberate difference from verl, in both modes: a ground truth that normalises to nothing
(``""``, ``"\\text{ cm}"``) is ``bad_ground_truth`` here, where verl scores 1.0 every response
whose box also normalises to nothing. A ground truth that is not a string is refused too
(``base.string_ground_truth``: verl scores every response 0 then).
"""

from __future__ import annotations

from typing import Any

from streamrl.errors import Failure
from streamrl.scorers.base import string_ground_truth

VERSION = "1"


class Unnormalisable(Exception):
    """MATH's normalisation cannot handle the string: the raw strings are compared."""


def last_box(text: str) -> str | None:
    """The answer MATH's rule reads (see the module docstring), or None."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                box = text[start:i + 1]
                return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else None
    return None


def _frac_args(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; a ``\\frac`` with
    one character after it leaves the whole string as it was; none at all is unnormalisable."""
    head, *rest = text.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if not part:
            raise Unnormalisable("\\frac with nothing after it")
        if part[0] == "{":
            out.append(part)
        elif len(part) < 2:
            return text
        elif part[1] != "{":
            out.append("{" + part[0] + "}{" + part[1] + "}" + part[2:])
        else:
            out.append("{" + part[0] + "}" + part[1:])
    return "".join(out)


def _slash_fraction(text: str) -> str:
    """``3/4`` (two plain integers) -> ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{a}}}{{{b}}}" if text == f"{a}/{b}" else text


def _sqrt_args(text: str) -> str:
    if "\\sqrt" not in text:
        return text
    head, *rest = text.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise Unnormalisable("\\sqrt with nothing after it")
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def strip(text: str) -> str:
    """MATH's normalisation (the module docstring); ``Unnormalisable`` where verl's raises."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in text:  # a unit on the right
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            raise Unnormalisable("more than one \\text{ unit")
        text = parts[0]
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _sqrt_args(text).replace(" ", "")
    text = _frac_args(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_fraction(text)


def equivalent(answer: str, ground_truth: str) -> bool:
    """MATH's string equivalence, as verl's ``is_equiv``."""
    try:
        return strip(answer) == strip(ground_truth)
    except Unnormalisable:
        return answer == ground_truth


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``{"score": 1.0 | 0.0, "pred": the box's contents or None}``."""
    truth = string_ground_truth(ground_truth, data_source, "math_reward")
    try:
        empty = strip(truth) == ""
    except Unnormalisable:
        empty = False
    if empty:
        raise Failure("bad_ground_truth", f"data_source {data_source!r}: the ground truth {truth[:80]!r} holds no "
                                          f"answer (verl would score 1.0 every response with an empty box)")
    pred = last_box(solution_str)
    return {"score": 1.0 if pred is not None and equivalent(pred, truth) else 0.0, "pred": pred}
