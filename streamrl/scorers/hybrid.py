"""Hybrid scorers: a weighted sum of other scorers (e.g. 0.7 rule + 0.3 judge).

The parts run concurrently. The result's ``parts`` field (it lands in ``reward_info``) holds
every part's own score and extra fields, so a reader sees how the sum came about. A part that
fails fails the whole record (it is retried, held or dead-lettered as that part's error says):
a sum with a missing term would be a silently different reward.
"""

from __future__ import annotations

import asyncio
from typing import Any

from streamrl.scorers.base import split_result


class HybridScorer:
    """Async scorer with verl's signature over ``parts``: name -> (scorer, weight)."""

    def __init__(self, name: str, parts: dict[str, tuple[Any, float]]):
        if not parts:
            raise ValueError(f"hybrid scorer {name!r} has no parts")
        self.name, self.parts = name, parts
        self.version = "+".join(f"{n}@{getattr(s, 'version', '0')}" for n, (s, _) in parts.items())

    async def start(self) -> None:
        """Parts are table entries of their own: the table starts them."""

    async def close(self) -> None:
        """Parts are closed by the table."""

    def set_share(self, fraction: float) -> None:
        """Parts receive their share from the table."""

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        names = list(self.parts)
        results = await asyncio.gather(*(
            self.parts[n][0](data_source, solution_str, ground_truth, extra_info, **kwargs)
            for n in names))
        total = 0.0
        parts: dict[str, Any] = {}
        for n, result in zip(names, results):
            score, extras = split_result(result, n)
            weight = self.parts[n][1]
            total += weight * score
            parts[n] = {"score": score, "weight": weight, **extras}
        return {"score": total, "parts": parts}
