"""Scorers: one small module per kind, each with verl's scorer signature (docs/contracts.md).

- ``rules``: the built-in rules, one module per family of verl's ``default_compute_score``
  (``gsm8k``, ``math_verify`` / ``math_reward``, ``math_dapo``, ``geo3k``, ``search_r1``,
  ``prime_math``), and ``default_compute_score`` over them;
- ``loader``: user functions (``file.py:name`` / ``module:name``), run inline, in threads or in
  worker processes with a timeout;
- ``judge`` (+ ``router``, ``ratelimit``): an LLM judge over the OpenAI chat API;
- ``model``: a reward model with dynamic batching; ``hybrid``: weighted sums of the others;
- ``base``: the errors (``ScoreError`` / ``ScorerUnavailable``) and the result shape.

The reward stage's table over them is ``streamrl.reward.table``. This package imports nothing
heavy at import time.
"""

from streamrl.scorers.base import ScoreError, ScorerUnavailable, split_result
from streamrl.scorers.rules import RULES, Rule, default_compute_score

__all__ = ["RULES", "Rule", "ScoreError", "ScorerUnavailable", "default_compute_score", "split_result"]
