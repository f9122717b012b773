"""Scorers: one small module per kind, each with verl's scorer signature (docs/contracts.md).

- ``rules``: the built-in rules (``gsm8k``, ``math``) and verl's ``default_compute_score``;
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
