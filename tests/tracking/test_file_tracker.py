"""verl's ``file`` logger (``trainer.logger=[file]``): each version's figures once, as verl's
JSON lines, also across a tracker reopened on the same directory (a resumed run)."""

from __future__ import annotations

import json

from streamrl.records import PolicyVersion
from streamrl.tracking.config import TrackingConfig
from streamrl.tracking.trackers import Tracker


def test_the_file_tracker_writes_verls_lines_once_across_a_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    cfg = TrackingConfig(loggers=["file"], project="p")
    tracker = Tracker(cfg, tmp_path, "e", {"learner": {"lr": 1e-3}})
    assert tracker.log_policy(PolicyVersion(version=1, metrics={"pg_loss": 0.5, "grad_norm": 2.0}))
    assert not tracker.log_policy(PolicyVersion(version=1, metrics={"pg_loss": 0.5}))  # announced again
    tracker.close()
    again = Tracker(cfg, tmp_path, "e", {})  # a resumed run: the same file, the ledger kept
    assert not again.log_policy(PolicyVersion(version=1, metrics={"pg_loss": 0.5}))
    assert again.log_policy(PolicyVersion(version=2, metrics={"pg_loss": 0.25}))
    again.close()
    lines = [json.loads(x) for x in (tmp_path / "p" / "e.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "data": {"actor/grad_norm": 2.0, "actor/pg_loss": 0.5}},
                     {"step": 2, "data": {"actor/pg_loss": 0.25}}]
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "here.jsonl"))  # verl's variable
    third = Tracker(TrackingConfig(loggers=["file"]), tmp_path / "other", "e", {})
    third.log_policy(PolicyVersion(version=1, metrics={"lr": 0.1}))
    third.close()
    assert json.loads((tmp_path / "here.jsonl").read_text()) == {"step": 1, "data": {"actor/lr": 0.1}}
