"""Validation and the experiment trackers through ``streamrl run``, on the real broker: a run given
verl's keys unchanged (``data.val_files``, ``trainer.test_freq``, ``trainer.logger``, ...), its
learner and eval stage SIGKILLed mid-run and restarted; then TensorBoard's event files, the
MLflow file store and the W&B offline run are read back with each library's own reader: every
version has verl's training scalars and every asked version the ``val-core`` one, each exactly
once, and ``streamrl replay --generate`` of a kept version gives the eval stage's figure."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, kill_stage, run_summary, start_run, wait_for_sync

# one run, one worker; its setup (the run, ~2 min alone) counts in the first test's limit
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("tracked-run"), pytest.mark.timeout(600)]

VERSIONS = 8
ASKED = [0, 3, 6, 8]  # val_before_train, every trainer.test_freq, and the last (not a multiple of it)
VAL = "val-core/digits/reward/mean@1"
#: verl's names the learner's figures are logged under (streamrl.tracking.trackers.VERL_NAMES)
TRAIN = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
         "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean",
         "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min", "response_length/mean",
         "response_length/max", "response_length/clip_ratio", "prompt_length/mean", "timing_s/step",
         "perf/throughput", "streamrl/staleness/mean", "streamrl/reward_lag", "streamrl/dead_letters"]
VERL_KEYS = ["data.val_files=[digits@1]", "trainer.test_freq=3", "trainer.val_before_train=True",
             "trainer.logger=[console,tensorboard,mlflow,wandb,file]", "trainer.project_name=streamrl-tests",
             "trainer.experiment_name=killed-twice", "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
             "actor_rollout_ref.rollout.val_kwargs.n=1"]


@pytest.fixture(scope="session")  # not "module": the group's worker may run other tests between these
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tracked")
    proc = start_run("configs/local.yaml", f"run.out_dir={out}", "run.reward_members=1", "feed.limit=300",
                     f"learner.versions={VERSIONS}", "eval.limit=24", "tracking.wandb_mode=offline",
                     "run.restart.backoff_s=0.5", *VERL_KEYS, env={"WANDB_SILENT": "true"})
    killed = []

    def kill_eval_then_learner() -> None:
        # the eval stage once it has published version 0, the learner a few versions later
        for verb in ("eval", "learner"):
            def ready() -> bool:
                if verb == "eval":
                    return any("eval: version 0:" in log.read_text(errors="replace") for log in out.glob("*/logs/eval.log"))
                return len(list(out.glob("*/checkpoints/ckpt-*"))) >= 2
            wait_for_sync(lambda: proc.poll() is not None or ready(), 240, f"the moment to kill {verb}", interval=0.2)
            assert proc.poll() is None, f"the run ended before the {verb} kill"
            kill_stage(proc, verb)
            killed.append(verb)

    summary, _, stderr = run_summary(proc, 600, kill_eval_then_learner)
    assert killed == ["eval", "learner"] and summary["restarts"] >= 2, summary
    summary["stderr"] = stderr
    return summary


def test_the_run_evaluates_each_asked_version_and_shows_it(run):
    assert run["ended"] == "done" and run["versions"] == VERSIONS
    curve = run["validation_by_version"][VAL]
    assert sorted(int(v) for v in curve) == ASKED  # the last one too: the run ended after it
    assert all(0.0 <= x <= 1.0 for x in curve.values())
    assert re.search(rf"{re.escape(VAL)} [0-9.]+ \(v\d+\)", run["stderr"])  # the status line
    assert f"{VAL} {curve[str(VERSIONS)]} at v{VERSIONS}" in run["stderr"].strip().splitlines()[-1]  # the last line


def tracking_dir(run) -> Path:
    return Path(run["out"]) / "tracking"


def test_tensorboard_has_every_figure_once(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = (tracking_dir(run) / "tensorboard").iterdir()
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in TRAIN:
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, VERSIONS + 1)), tag
    val = acc.Scalars(VAL)
    assert [e.step for e in val] == ASKED
    curve = run["validation_by_version"][VAL]
    assert all(round(e.value, 4) == pytest.approx(curve[str(e.step)], abs=1e-4) for e in val)


def test_mlflow_has_every_figure_once(run):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    from streamrl.tracking.trackers import mlflow_store_uri

    client = MlflowClient(tracking_uri=mlflow_store_uri(tracking_dir(run)))  # the run's default store
    experiment = client.get_experiment_by_name("streamrl-tests")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "killed-twice"
    assert found.data.params["learner/versions"] == str(VERSIONS)  # the config, once, as parameters
    for tag in TRAIN:
        assert sorted(m.step for m in client.get_metric_history(found.info.run_id, tag)) == list(range(1, VERSIONS + 1))
    val = client.get_metric_history(found.info.run_id, VAL.replace("@", "_at_"))  # as verl sanitises it
    assert sorted(m.step for m in val) == ASKED


def test_verls_file_logger_has_every_figure_once(run):
    """verl's ``file`` logger: JSON lines ``{"step", "data"}`` under <project>/<experiment>.jsonl."""
    path = tracking_dir(run) / "streamrl-tests" / "killed-twice.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for tag in TRAIN:
        assert [x["step"] for x in lines if tag in x["data"]] == list(range(1, VERSIONS + 1)), tag
    assert sorted(x["step"] for x in lines if VAL in x["data"]) == ASKED


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B run file: LevelDB-log framing (32 KiB blocks of records with a
    7-byte header: checksum, length, type full/first/middle/last), each record one of W&B's own
    protobuf ``Record``s. W&B 0.2x+ dropped its Python reader of these files (its Go core
    writes them); the records are read with W&B's protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block = path.read_bytes(), 7, 32768  # a 7-byte file header (":W&B", magic, version)
    records, part = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            records.append(part + chunk)
    rows = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_run_has_every_figure_once(run):
    files = list((tracking_dir(run) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, list((tracking_dir(run) / "wandb").rglob("*"))
    rows = [row for f in files for row in wandb_history(f)]
    for tag in TRAIN:
        assert sorted(r["streamrl/version"] for r in rows if tag in r) == list(range(1, VERSIONS + 1)), tag
    assert sorted(r["streamrl/version"] for r in rows if VAL in r) == ASKED
    assert "WANDB_API_KEY" not in "".join(f.read_bytes().decode(errors="replace") for f in files)


def test_replay_of_a_kept_version_gives_the_eval_stages_figure(run, tmp_path):
    weights = Path(run["out"]) / "weights" / "v6"
    assert weights.exists()  # kept for the eval stage (learner.keep_every follows eval.every)
    rc = subprocess.run(
        [sys.executable, "-m", "streamrl", "replay", "--config", "configs/local.yaml", "--generate", "--policy",
         str(weights), "--prompts", "digits@1", "--limit", "24", "--scorer", "digits", "--out", str(tmp_path),
         "--no-progress", "rollout.temperature=0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["validation"]["digits"]["reward/mean@1"] == pytest.approx(
        run["validation_by_version"][VAL]["6"], abs=1e-4)
