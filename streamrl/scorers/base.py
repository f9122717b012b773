"""What every scorer shares: the errors that tell the reward stage what to do with a failure.

A scorer is any callable with verl's signature (DESIGN.md), sync or async::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

A dict result carries ``"score"`` plus extra fields, which land in ``reward_info``. Built-in rule
scorers, user functions, the LLM judge and the reward model all present that one signature.
"""

from __future__ import annotations


class ScoreError(Exception):
    """This record cannot be scored (e.g. the judge's answer has no score). The reward stage
    retries a bounded number of times, then sends the record to dead letters with the reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ScorerUnavailable(Exception):
    """The scorer's backend is down (every judge / reward server failing). The reward stage holds
    the record and tries again later (back-pressure): an outage is never scored 0."""
