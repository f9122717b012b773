"""The prompt feed: a dataset to the prompts topic, one ``Prompt`` per row and epoch.

- ``config``: ``FeedConfig`` (the ``feed`` section);
- ``prompts``: rows to prompts (verl's format or a template), their group ids, prompt length;
- ``stage``: ``Feed``, the stage that publishes them (``streamrl feed``), and ``publish_feed``.
"""

from streamrl.feed.config import FeedConfig

__all__ = ["FeedConfig"]
