"""Replay: offline evaluation from topics.

Every trajectory and reward stays in Kafka for the retention period. A replay reads a range of
a topic as a plain reader (no consumer group, no commits: production groups never notice), re-
scores each record once through the reward stage's own scoring path, and reports old against
new rewards; or it generates with a policy checkpoint on held-out prompts and scores that.

- ``reader``: bounds (offsets, times, versions), reading, decoding, de-duplication by ``id``;
- ``rescore``: what ``--scorer`` names, and scoring with the reward stage's ``score``;
- ``report``: statistics and the files (JSON, Markdown, PNG, results JSONL / parquet);
- ``evaluate``: ``replay_topic`` and ``evaluate_policy``, which compose the three.

``streamrl replay`` (``streamrl.commands.replay``) is the command line.
"""

from streamrl.replay.evaluate import evaluate_policy, replay_topic
from streamrl.replay.sources import Bound, BoundError, Range, parse_bound
from streamrl.replay.rescore import resolve_scorer

__all__ = ["Bound", "BoundError", "Range", "evaluate_policy", "parse_bound", "replay_topic", "resolve_scorer"]
