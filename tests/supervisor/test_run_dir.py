"""A failed run never deletes its directory (issue 57): whatever fails outside the stages (Ray,
the broker, a check, a bug), ``runs/<id>/`` keeps what it had, ``summary.json`` says ``ended:
failed`` and why; only a new run that wrote nothing leaves no directory."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.errors import StreamrlError
from streamrl.pipeline_config import load_config
from streamrl.supervisor.run import kept


def test_a_failed_run_keeps_what_it_had_and_says_why(tmp_path: Path, capsys):
    out = tmp_path / "runs" / "20260101-000000"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "learner.log").write_text("metrics: http://127.0.0.1:1/metrics\n")
    (out / "observation.json").write_text(json.dumps({"sessions": [{"rollouts": 64, "rewarded": 60}]}))
    summary = kept(load_config(), out, None, StreamrlError("stage 'rollout-0' was not placed in 30 s: ..."))
    assert summary is not None and (out / "logs" / "learner.log").is_file()
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["ended"] == "failed" and summary["out"] == str(out)
    assert summary["failure"] == {"stage": "run", "error": "stage 'rollout-0' was not placed in 30 s: ..."}
    assert summary["records"] == {"rollouts": 64, "rewarded": 60} and "resume" not in summary  # no checkpoint yet
    assert f"{out} is kept" in capsys.readouterr().err
    # a bug is named by its type; the directory stays all the same
    summary = kept(load_config(), out, None, KeyError("x"))
    assert summary is not None and summary["failure"]["error"] == "KeyError: 'x'"


def test_a_new_run_that_wrote_nothing_leaves_no_directory(tmp_path: Path):
    out = tmp_path / "runs" / "20260101-000000"
    (out / "logs").mkdir(parents=True)
    assert kept(load_config(), out, None, StreamrlError("the broker does not answer")) is None
    assert not out.exists()
