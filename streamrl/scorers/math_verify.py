"""Math: is the response's final answer equivalent to the reference?

Equivalence is Hugging Face's ``math-verify`` (LaTeX and plain expressions parsed to SymPy, then
compared symbolically and numerically: ``\\frac{1}{2}`` = ``0.5``, ``x=3`` = ``3``, intervals,
sets, matrices), not a hand-written normaliser. It can be slow on adversarial input, so the
table runs this scorer in a worker process with a per-record timeout (``executor: process``);
math-verify's own signal-based timeouts are switched off because they only work on a main
thread, and the worker's timeout covers them.
"""

from __future__ import annotations

from typing import Any

from streamrl.scorers.base import ScoreError

VERSION = "1"


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any] | None = None, *, score: float = 1.0,
                  format_score: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    """``score`` if the last answer in ``solution_str`` (boxed, ``$...$``, or a bare expression)
    equals ``ground_truth``; ``format_score`` if an answer was found but differs; else 0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if ground_truth is None:
        raise ScoreError("no_ground_truth", "a math record needs ground_truth")
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    text = ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"
    gold = parse(text, extraction_config=configs, parsing_timeout=None)
    if not gold:
        raise ScoreError("bad_ground_truth", f"math-verify cannot parse the ground truth {ground_truth[:80]!r}")
    pred = parse(solution_str, extraction_config=configs, parsing_timeout=None)
    if not pred:
        return {"score": 0.0, "pred": None}
    ok = verify(gold, pred, timeout_seconds=None)
    return {"score": float(score if ok else format_score), "pred": str(pred[-1])}
