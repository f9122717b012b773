"""What a topic or an archive already holds, without re-scoring (``streamrl replay`` with no
``--scorer``): the stored rewards by policy version and by data source, and the dead letters
by stage and reason."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Iterable

from streamrl.records import Rewarded
from streamrl.replay.sources import Located
from streamrl.replay.report import old_reward


def _stats(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "mean_reward": sum(values) / len(values) if values else None}


def inventory(records: Iterable[Located], dead_letters: Iterable[tuple[str, str]], *,
              source: dict[str, Any], duplicates: int = 0) -> dict[str, Any]:
    """The inventory as plain data (``source`` says where it was read)."""
    by_version: dict[int, list[float]] = defaultdict(list)
    by_source: dict[str, list[float]] = defaultdict(list)
    unrewarded = 0
    for loc in records:
        reward = old_reward(loc.record) if isinstance(loc.record, Rewarded) else None
        if reward is None:
            unrewarded += 1
            continue
        by_version[loc.record.policy_version].append(reward)
        by_source[loc.record.data_source].append(reward)
    letters = Counter(f"{stage}: {reason}" for stage, reason in dead_letters)
    return {"source": source, "records": sum(len(v) for v in by_version.values()) + unrewarded,
            "unrewarded": unrewarded, "duplicates": duplicates,
            "by_version": {str(v): _stats(by_version[v]) for v in sorted(by_version)},
            "by_data_source": {s: _stats(by_source[s]) for s in sorted(by_source)},
            "dead_letters": dict(sorted(letters.items(), key=lambda kv: (-kv[1], kv[0]))),
            "dead_letter_count": sum(letters.values())}


def render(inv: dict[str, Any]) -> str:
    """The inventory as a few aligned tables for a terminal."""
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    src = inv["source"]
    lines = [f"{src.get('archive') or src.get('topic')}: {inv['records']} records "
             f"({inv['duplicates']} duplicates dropped), {inv['dead_letter_count']} dead letters"]
    for title, key in (("policy_version", "by_version"), ("data_source", "by_data_source")):
        if inv[key]:
            lines += ["", f"{title:>16}  {'records':>8}  {'mean reward':>11}"]
            lines += [f"{k:>16}  {v['n']:>8}  {fmt(v['mean_reward']):>11}" for k, v in inv[key].items()]
    if inv["dead_letters"]:
        lines += ["", f"{'dead letters (stage: reason)':<40}  {'count':>6}"]
        lines += [f"{k:<40}  {n:>6}" for k, n in inv["dead_letters"].items()]
    return "\n".join(lines)
