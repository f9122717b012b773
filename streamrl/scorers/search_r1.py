"""Search-R1's exact match (``searchR1_nq``, ``searchR1_triviaqa``, ``searchR1_popqa``,
``searchR1_hotpotqa``, ``searchR1_2wikimultihopqa``, ``searchR1_musique``,
``searchR1_bamboogle``), as verl's ``search_r1_like_qa_em`` scores it.

The answer is the last ``<answer>...</answer>`` of the response (across lines), stripped. It
matches when, normalised as SQuAD's evaluation normalises (lower case, punctuation dropped,
the articles ``a`` / ``an`` / ``the`` dropped, whitespace collapsed), it equals one of the ground
truth's ``target`` answers normalised the same way. A match earns ``score`` (1.0), or a quarter
of it when the response writes more than ten ``<answer>`` or ``</answer>`` tags (verl's guard
against spraying tags); a wrong answer earns ``format_score`` (0.0); no answer, 0.

The ground truth is verl's ``{"target": answer or [answers]}``, as an object or as its JSON text
(a record's ``ground_truth`` is text: the feed writes a verl row's structure as JSON). Beyond verl, which raises on
them, a bare string or list is read as the target itself and a number as its text. A record whose
ground truth has no usable target (null, an object without ``target``, an empty list) is the
record's error, whatever the response (verl scores 0 a response without an answer before it
looks at the ground truth).
"""

from __future__ import annotations

import re
import string
from collections import deque
from typing import Any

import orjson

from streamrl.scorers.base import ScoreError, ground_truth_text

VERSION = "1"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_TAGS = 10


def normalize(text: str) -> str:
    """SQuAD's answer normalisation."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(solution_str: str) -> str | None:
    """The last ``<answer>...</answer>``'s contents, stripped; None when there is none."""
    last = deque(_ANSWER.finditer(solution_str), maxlen=1)
    return last[0].group(1).strip() if last else None


def targets(ground_truth: Any, data_source: str) -> list[str]:
    """The answers a response may give (see the module docstring)."""
    if isinstance(ground_truth, str) and ground_truth[:1] in ("{", "["):
        try:  # the feed writes a verl row's structured ground truth as JSON (the record's field is text)
            ground_truth = orjson.loads(ground_truth)
        except orjson.JSONDecodeError:
            pass  # an answer that merely starts with a bracket
    value = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ScoreError("bad_ground_truth", f"data_source {data_source!r}: the ground truth lists no answer")
    return [ground_truth_text(item, data_source) for item in items]


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict[str, Any] | None = None, *, format_score: float = 0.0,
                  score: float = 1.0, **kwargs: Any) -> dict[str, Any]:
    """``{"score", "pred"}``: ``pred`` is the answer read, or None."""
    golden = {normalize(t) for t in targets(ground_truth, data_source)}
    pred = extract_answer(solution_str)
    if pred is None:
        return {"score": 0.0, "pred": None}
    if normalize(pred) not in golden:
        return {"score": float(format_score), "pred": pred}
    if solution_str.count("<answer>") > MAX_TAGS or solution_str.count("</answer>") > MAX_TAGS:
        return {"score": score / 4, "pred": pred}
    return {"score": float(score), "pred": pred}
