"""Several teachers, one per data source (verl's ``distillation.teacher_models``), under
``streamrl run`` on the real broker: GSM8K rows under three data sources, a teacher for two of
them (the tiny architecture from two seeds, so the log-probs tell which teacher annotated a
record) and none for the third (``teacher.unserved: train``). One teacher's only member is
SIGKILLed mid-run: the other teacher's records keep flowing while it is down, every record is
annotated by its own teacher (or handed on unannotated, the third source), and the learner
trains each once."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, Distilled, PolicyVersion, Rewarded
from tests.helpers import (alive, descendants, gsm8k_path, read_topic_sync, recompute_logprobs, run_summary, start_run,
                           wait_for_sync)

pytestmark = pytest.mark.e2e

SOURCES = ("gsm8k", "gsm8k_b", "gsm8k_c")  # math's, other's, no teacher's
SEEDS = {"math": 1, "other": 2}


def _rows(path: Path, n: int) -> None:
    """GSM8K rows, their data source taking turns among ``SOURCES``."""
    lines = gsm8k_path("train").read_text().splitlines()[:n]
    path.write_text("".join(json.dumps({**json.loads(line), "data_source": SOURCES[i % 3]}) + "\n"
                            for i, line in enumerate(lines)))


def _teacher_pid(run_pid: int, name: str) -> int | None:
    """The pid of teacher ``name``'s member (``streamrl teacher ... --teacher NAME``)."""
    for pid in descendants(run_pid):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"teacher" in argv and b"--teacher" in argv and argv[argv.index(b"--teacher") + 1] == name.encode() \
                and alive(pid):
            return pid
    return None


@pytest.mark.timeout(900)
def test_two_teachers_each_annotate_their_own_source_and_a_killed_one_holds_only_its_own(tmp_path, bootstrap):
    prefix = f"teachers{uuid.uuid4().hex[:6]}"
    data = tmp_path / "rows.jsonl"
    _rows(data, 600)
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    teachers = [f"+distillation.teacher_models.{name}.{k}={v}" for name, source in (("math", "gsm8k"),
                                                                                    ("other", "gsm8k_b"))
                for k, v in (("key", source), ("model_path", "tiny"), ("seed", SEEDS[name]))]
    proc = start_run("configs/local-gsm8k.yaml", f"feed.dataset={data}", "feed.data_source=''", "feed.limit=600",
                     "--bootstrap-servers", bootstrap, f"run.out_dir={tmp_path}", f"bus.topic_prefix={prefix}",
                     f"learner.consumer_group={prefix}-learner", f"reward.group={prefix}-reward",
                     f"teacher.group={prefix}-teacher", "reward.scorers.gsm8k.data_sources=[gsm8k,gsm8k_b,gsm8k_c]",
                     "learner.versions=16", "feed.group_size=4", "learner.groups_per_mini_batch=8",
                     "rollout.trajectories_per_version=32", "rollout.max_new_tokens=6", "run.reward_members=1",
                     "learner.group_timeout_s=5", "learner.allow_partial_groups=true", "run.restart.backoff_s=0.5",
                     "run.timeout_s=450", "distillation.enabled=true", "teacher.batch_size=8", "teacher.unserved=train",
                     *teachers, env={"PYTHONUNBUFFERED": "1"})

    def annotated() -> list[Distilled]:
        try:
            return [Distilled.decode(m.value) for m in read_topic_sync(Bus(cfg), "distilled")]
        except LookupError:  # the run has not created the topics yet
            return []

    killed_at: list[float] = []

    def kill_other() -> None:
        wait_for_sync(lambda: proc.poll() is None and sum(d.teacher.get("name") == "other" for d in annotated()) >= 4,
                      300, "the other teacher's first records", interval=1.0)
        pid = wait_for_sync(lambda: _teacher_pid(proc.pid, "other"), 30, "the other teacher's process")
        killed_at.append(time.time())
        os.kill(pid, signal.SIGKILL)

    summary, _, err = run_summary(proc, 480, kill_other)
    assert summary["ended"] == "done" and summary["versions"] == 16, summary
    assert summary["restarts"] >= 1
    # the status line: each teacher's distilled records and its group's lag
    assert "distilled math " in err and "distilled other " in err and "(teacher lag " in err
    assert "run: teachers: math (gsm8k" in err

    bus = Bus(cfg)
    rewarded = {r.id: r for r in (Rewarded.decode(m.value) for m in read_topic_sync(bus, "rewarded"))}
    out = annotated()
    dead = {d.record_id for d in (DeadLetter.decode(m.value, 2**26) for m in read_topic_sync(bus, "deadletter"))
            if d.stage == "teacher"}
    ids = {d.id for d in out}
    assert rewarded and not set(rewarded) - ids - dead, f"{len(set(rewarded) - ids - dead)} records never distilled"
    assert ids <= set(rewarded) and not dead
    by_source: dict[str, set[str]] = {}
    for d in out:  # each record by its own teacher (the third source: handed on unannotated)
        expected = {"gsm8k": "math", "gsm8k_b": "other"}.get(d.data_source)
        if expected is None:
            assert d.teacher.get("unserved") and len(d.array("teacher_logprobs")) == 0, d.teacher
        else:
            assert d.teacher["name"] == expected and d.teacher["key"] == d.data_source, (d.data_source, d.teacher)
        by_source.setdefault(d.data_source, set()).add(d.id)
    assert all(by_source.get(s) for s in SOURCES), {s: len(v) for s, v in by_source.items()}
    counts = summary["distilled_by_teacher"]
    assert counts == {"math": len(by_source["gsm8k"]), "other": len(by_source["gsm8k_b"]),
                      "(none)": len(by_source["gsm8k_c"])}, counts

    # the log-probs tell which teacher: each matches its own teacher's model, not the other's
    import torch

    from streamrl.policy import load_policy

    torch.set_num_threads(1)  # a tiny model: one thread is quickest on a loaded machine
    models = {name: load_policy("tiny", seed=seed)[0] for name, seed in SEEDS.items()}
    checked = 0
    for d in out:
        name = d.teacher.get("name")
        if name is None or checked >= 12:
            continue
        lp = d.array("teacher_logprobs")
        own, other = (recompute_logprobs(models[n], d.array("prompt_ids"), d.array("response_ids"))
                      for n in (name, "other" if name == "math" else "math"))
        np.testing.assert_allclose(lp, own, rtol=1e-4, atol=1e-5)
        assert not np.allclose(lp, other, rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked == 12

    # while the other teacher was down, math's records kept coming (they never wait for it)
    back = min((d.annotated_at for d in out if d.teacher.get("name") == "other" and d.annotated_at > killed_at[0]),
               default=None)
    assert back is not None, "the other teacher never came back"
    meanwhile = [d for d in out if d.teacher.get("name") == "math" and killed_at[0] < d.annotated_at < back]
    assert meanwhile, f"no math record annotated in the {back - killed_at[0]:.1f} s the other teacher was down"

    trained = max(PolicyVersion.decode(m.value).trained_records for m in read_topic_sync(bus, "policy"))
    assert 0 < trained <= len(ids)  # each id at most once, whatever the topic holds twice
    print(f"two teachers: {len(rewarded)} rewarded, {len(out)} distilled messages, {len(ids)} distinct "
          f"({counts}), {len(dead)} dead-lettered at the teachers, {trained} trained; the other teacher down "
          f"{back - killed_at[0]:.1f} s, {len(meanwhile)} math records annotated meanwhile")
