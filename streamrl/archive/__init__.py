"""The topic archive: every ``rollouts``, ``rewarded`` and ``deadletter`` record in Parquet files
through fsspec (a local path, ``file://``, ``s3://``, ``gs://``), for replay after the broker or
its retention is gone.

- ``config``: ``ArchiveConfig`` (``archive:`` in a pipeline YAML);
- ``store``: the file layout and schema, writing (``Writer``) and reading (``read_tables``,
  ``record_dict``);
- ``stage``: ``ArchiveStage``, the consumer group that writes them (``streamrl archive``).

Replay reads archives through ``streamrl.replay.sources.read_archive``.
"""
