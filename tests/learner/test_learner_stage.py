"""The learner's logic on the in-memory bus (``streamrl.testing``: ``run_stage``, or the
``memory_bus`` fixture where a test feeds it while it runs): versions, staleness, duplicates,
groups, checkpoints and restart, the synchronous-GRPO equivalence, missing log-probs. The CLI's
SIGTERM runs a real process on the real broker."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl import metrics, resume
from streamrl.learner.config import LearnerConfig
from streamrl.learner.stage import Learner
from streamrl.policy import load_policy
from streamrl.records import DeadLetter, PolicyVersion, Rewarded
from streamrl.testing import run_stage
from tests.helpers import group, learner_cfg, publish, read_topic, recompute_logprobs, tiny, wait_for

def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def policies(msgs) -> list[PolicyVersion]:
    return [PolicyVersion.decode(m.value) for m in msgs]


def letters(msgs) -> list[DeadLetter]:
    return [DeadLetter.decode(m.value) for m in msgs]


def test_trains_versions_drops_stale_and_duplicates(memory_bus, tmp_path):
    """Strictly on-policy (max_staleness=0): two versions from fresh groups; a version-0 group
    that arrives at version 1 is dead-lettered as stale; duplicates train once; an incomplete
    group times out; a record without log-probs is dead-lettered (missing_logprobs=error)."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, max_staleness=0, versions=2, group_timeout_s=1.0)
    dup_before = metrics.LEARNER_RECORDS.labels("duplicate")._value.get()
    timeouts = metrics.LEARNER_DROPPED.labels("group_timeout")

    async def go():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        timeouts_before = timeouts._value.get()
        await publish(bus, group("i", size=3)[:1])  # 1 of 3, never completed
        await wait_for(lambda: timeouts._value.get() > timeouts_before, what="group timeout")
        first = group("a") + group("b")
        no_lp = group("n", size=1, logprobs=False)
        await publish(bus, first + [first[0], first[3]] + no_lp)
        await wait_for(lambda: learner.version >= 1, what="version 1")
        stale = group("s", version=0)
        dups = metrics.LEARNER_RECORDS.labels("duplicate")
        await publish(bus, stale + [first[1]])  # the third duplicate is taken before version 2 ends the run
        await wait_for(lambda: dups._value.get() - dup_before >= 3, what="third duplicate")
        await publish(bus, group("c", version=1) + group("d", version=1))
        state = await asyncio.wait_for(task, 60)
        return learner, state, first, stale

    learner, state, first, stale = asyncio.run(go())
    assert state.version == 2 and state.trained_records == 8  # a, b, c, d once each
    assert metrics.LEARNER_RECORDS.labels("duplicate")._value.get() - dup_before >= 3

    pols = policies(asyncio.run(read_topic(bus, "policy", 3)))
    assert [p.version for p in pols] == [0, 1, 2]
    assert pols[-1].trained_records >= 8 and "loss" in pols[-1].metrics
    v0 = params(load_policy(pols[0].weights_uri)[0])
    for p in pols[1:]:
        w = params(load_policy(p.weights_uri)[0])
        assert any(not torch.equal(w[k], v0[k]) for k in v0), f"v{p.version} equals v0"
    assert Path(pols[0].weights_uri) == (tmp_path / "weights" / "v0").resolve()

    dls = letters(asyncio.run(read_topic(bus, "deadletter", 4)))
    by_reason = {}
    for d in dls:
        by_reason.setdefault(d.reason, set()).add(d.record_id)
        assert d.stage == "learner" and Rewarded.decode(d.original_value()).id == d.record_id
    assert by_reason["stale"] == {r.id for r in stale}
    assert by_reason["no_logprobs"] == {"n-0"}
    assert by_reason["group_timeout"] == {"i-0"}


def test_a_second_copy_of_a_trajectory_is_dead_lettered_a_redelivery_skipped(memory_bus, tmp_path):
    """A rollout worker killed before committing its prompt generates the group again: same ids,
    another ``created_at``. The second copy is not trained but dead-lettered (``regenerated``),
    which is how the staleness gate counts it finished (left as a plain duplicate, 36 such
    copies froze the chaos test's run); a redelivery of either copy stays a skipped duplicate."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, max_staleness=0, versions=1)
    first = group("a") + group("b")
    again = replace(first[0], created_at=first[0].created_at + 5.0, response=first[0].response + "x")
    dups = metrics.LEARNER_RECORDS.labels("duplicate")
    dup_before = dups._value.get()

    async def go():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, [first[0], again, again, first[0], *first[1:]])
        return await asyncio.wait_for(task, 60)

    state = asyncio.run(go())
    assert state.trained_records == 4
    dls = letters(asyncio.run(read_topic(bus, "deadletter", 1)))
    assert [(d.reason, d.record_id) for d in dls] == [("regenerated", first[0].id)]
    assert Rewarded.decode(dls[0].original_value()).created_at == again.created_at  # the copy, not the first
    assert dups._value.get() - dup_before == 2


def test_restart_resumes_from_checkpoint(memory_bus, tmp_path):
    """Killed between checkpoints: what was trained after the checkpoint is trained again, what
    was before is not, and the de-dup window from the checkpoint still skips duplicates."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, mini_batches_per_version=2, versions=2)

    g1 = group("g1")

    async def first_life():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, g1 + group("g2"))
        await wait_for(lambda: learner.version == 1 and learner.last_checkpoint, what="v1 + checkpoint")
        await publish(bus, group("g3") + [g1[0]])  # g1-0 redelivered, after the checkpoint
        await wait_for(lambda: learner.state.mini_batches == 1, what="g3 trained")
        task.cancel()  # a crash: no checkpoint after v1
        with pytest.raises(asyncio.CancelledError):
            await task
        return learner

    a = asyncio.run(first_life())
    assert a.state.trained_records == 6
    ckpt = resume.latest(cfg.checkpoint_dir)
    saved = resume.load_state(ckpt)
    assert saved.version == 1 and saved.trained_records == 4 and saved.mini_batches == 0
    assert sum(saved.offsets.values()) == 4  # g1 and g2 consumed, nothing more

    dup_before = metrics.LEARNER_RECORDS.labels("duplicate")._value.get()

    async def second_life():
        learner = Learner(bus, cfg)
        assert learner.resumed_from == ckpt and learner.version == 1
        loaded = params(learner.trainer.model)
        saved_w = params(load_policy(str(resume.policy_dir(ckpt)))[0])
        assert all(torch.equal(loaded[k], saved_w[k]) for k in loaded)
        assert learner.trainer.optimizer.state  # Adam moments came back
        task = asyncio.create_task(learner.run())
        await publish(bus, group("g4"))
        return learner, await asyncio.wait_for(task, 60)

    b, state = asyncio.run(second_life())
    assert state.version == 2
    assert state.trained_records == 8  # g1, g2 (before the crash) + g3 (again) + g4
    assert metrics.LEARNER_RECORDS.labels("duplicate")._value.get() - dup_before == 1  # g1-0
    final = resume.load_state(resume.latest(cfg.checkpoint_dir))
    assert final.version == 2 and sum(final.offsets.values()) == 9
    assert len(resume.checkpoints(cfg.checkpoint_dir)) == cfg.keep_checkpoints


def test_killed_between_checkpoint_and_announcement_announces_the_versions_figures(memory_bus, tmp_path):
    """The checkpoint of version 1 is written, the learner dies before announcing it: restarted,
    it announces version 1 with the figures it trained (trackers log each version from that
    record; an announcement without them would leave a hole in every curve)."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, versions=2)

    async def first_life():
        learner = Learner(bus, cfg)
        announce = learner._announce

        async def killed_before_v1(version, summary):
            if version == 1:
                await asyncio.Event().wait()  # never returns: the process dies here
            return await announce(version, summary)

        learner._announce = killed_before_v1
        task = asyncio.create_task(learner.run())
        await publish(bus, group("g1"))
        await wait_for(lambda: learner.last_checkpoint and learner.version == 1, what="the checkpoint of v1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(first_life())
    assert [p.version for p in policies(asyncio.run(read_topic(bus, "policy")))] == [0]
    saved = resume.load_state(resume.latest(cfg.checkpoint_dir))
    assert saved.version == 1 and "pg_loss" in saved.summary

    async def second_life():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, group("g2"))
        await asyncio.wait_for(task, 60)

    asyncio.run(second_life())
    announced = {p.version: p.metrics for p in policies(asyncio.run(read_topic(bus, "policy")))}
    assert sorted(announced) == [0, 1, 2]
    assert announced[1] == pytest.approx(saved.summary) and "pg_loss" in announced[2]


def plain_grpo_step(records, cfg: LearnerConfig) -> dict[str, torch.Tensor]:
    """A synchronous GRPO step written out by hand: group-normalised advantages, on-policy
    policy gradient averaged over all response tokens, gradient clipping, one AdamW step."""
    model, _ = load_policy("tiny", seed=cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    records = sorted(records, key=lambda r: r.id)
    by_group = {}
    for r in records:
        by_group.setdefault(r.group_id, []).append(r.reward)
    total_tokens = sum(len(r.array("response_ids")) for r in records)
    loss = 0.0
    for r in records:
        rs = np.array(by_group[r.group_id], dtype=np.float32)
        adv = (r.reward - rs.mean()) / (rs.std(ddof=1) + 1e-6)
        logp = recompute_logprobs(model, r.array("prompt_ids"), r.array("response_ids"), grad=True)
        ratio = torch.exp(logp - torch.from_numpy(r.array("response_logprobs").copy()))
        loss = loss + (-adv * ratio).sum() / total_tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return params(model)


def test_on_policy_update_equals_a_synchronous_grpo_step(memory_bus, tmp_path):
    cfg = learner_cfg(tmp_path, max_staleness=0, groups_per_mini_batch=2, versions=1,
                      micro_batch_size=16)
    records = group("x", size=3, rewards=[1.0, 0.0, 0.5]) + group("y", size=3, rewards=[0.2, 0.9, 0.9])

    pols = run_stage(Learner(memory_bus, cfg), records, timeout_s=60)["policy"]  # versions=1: it ends
    learned = params(load_policy(pols[-1].weights_uri)[0])
    want = plain_grpo_step(records, cfg)
    v0 = params(tiny()[0])
    moved = torch.cat([(want[k] - v0[k]).abs().flatten() for k in want])
    diff = torch.cat([(learned[k] - want[k]).abs().flatten() for k in want])
    assert moved.max() > 0.9 * cfg.lr  # the step did move the weights
    # Equal up to float rounding. Adam's first step is lr * g / (|g| + eps): where the exact
    # gradient is ~0 (advantages sum to zero in a group) the batched and the per-sample forward
    # passes' rounding (~1e-9) can move a handful of coordinates by any part of lr, even flip
    # their sign. So: few coordinates differ at all, and where the reference moved by nearly a
    # full lr (|g| >= ~10 eps, far above rounding) the two agree to 2% of lr.
    assert (diff > 1e-7).float().mean() < 1e-3, (diff > 1e-7).sum()
    assert diff.max() <= 2.01 * cfg.lr, diff.max()
    firm = moved > 0.9 * cfg.lr
    assert firm.sum() > 100 and diff[firm].max() < 0.02 * cfg.lr, (firm.sum(), diff[firm].max())


def test_recompute_partial_groups_and_the_other_objective_options(memory_bus, tmp_path):
    """Text-only records (no token ids, no log-probs) train when missing_logprobs=recompute; an
    incomplete group trains as a partial group when allowed; the decoupled objective, KL to the
    reference, entropy bonus and seq-mean-token-mean run end to end."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, missing_logprobs="recompute", groups_per_mini_batch=2, versions=1,
                      allow_partial_groups=True, group_timeout_s=1.0, decoupled=True, kl_coef=0.1,
                      entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean", micro_batch_size=2)
    partial = metrics.LEARNER_GROUPS.labels("partial")
    partial_before = partial._value.get()

    out = run_stage(Learner(bus, cfg), group("t", size=2, tokens=False, rewards=[1.0, 0.0])
                    + group("p", size=4, rewards=[1.0, 0.0, 0.0, 1.0])[:3], timeout_s=60)
    state = out.result
    assert state.version == 1 and state.trained_records == 5
    assert partial._value.get() - partial_before == 1
    pol = out["policy"][-1]
    assert pol.version == 1 and {"kl", "entropy", "is_weight"} <= pol.metrics.keys()


def _staleness_counts() -> dict[str, float]:
    """Cumulative bucket counts of the trained-records staleness histogram."""
    return {s.labels["le"]: s.value for m in metrics.LEARNER_STALENESS.collect() for s in m.samples
            if s.name.endswith("_bucket")}


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_staleness_bound_holds_over_random_version_mixes(memory_bus, tmp_path, max_staleness):
    """Groups generated by random older versions arrive while the learner moves on: every
    trained record is within the bound at the version its update started from (the exported
    histogram), every record is either trained or dead-lettered as stale, none lost."""
    bus = memory_bus
    rng = np.random.default_rng(max_staleness)
    versions = 4
    cfg = learner_cfg(tmp_path, max_staleness=max_staleness, groups_per_mini_batch=1, versions=versions)
    before = _staleness_counts()
    published: list[Rewarded] = []

    async def go():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        for v in range(versions):
            await wait_for(lambda: learner.version >= v, what=f"version {v}")
            batch = group(f"f{v}", version=learner.version)  # one fresh group keeps it moving
            for k in range(2):
                pv = int(rng.integers(max(0, learner.version - 4), learner.version + 1))
                batch += group(f"m{v}-{k}", version=pv)
            published.extend(batch)
            await publish(bus, batch)
        state = await asyncio.wait_for(task, 60)
        return learner, state

    learner, state = asyncio.run(go())
    after = _staleness_counts()
    trained = after["+Inf"] - before.get("+Inf", 0)
    within = after[f"{float(max_staleness)}"] - before.get(f"{float(max_staleness)}", 0)
    assert trained == state.trained_records and within == trained
    dropped = state.consumed_records - state.trained_records
    dls = letters(asyncio.run(read_topic(bus, "deadletter", dropped, timeout_s=10))) if dropped else []
    assert len(dls) == dropped  # every record consumed is trained or dead-lettered, once
    by_id = {r.id: r for r in published}
    for d in dls:
        assert d.reason == "stale"
        # a record is only dropped as stale if it was out of the bound at some version <= the last
        assert state.version - by_id[d.record_id].policy_version > max_staleness
    if max_staleness == 0:
        assert dropped > 0  # the random mix did contain stale groups


@pytest.mark.parametrize("nproc,sig", [
    pytest.param(1, signal.SIGTERM, id="1-rank-sigterm"),
    pytest.param(2, signal.SIGTERM, id="2-ranks-sigterm", marks=pytest.mark.e2e),  # 3 interpreters with torch
    pytest.param(2, signal.SIGINT, id="2-ranks-ctrl-c", marks=pytest.mark.e2e)])
def test_cli_serves_metrics_and_checkpoints_on_sigterm(bus, bus_config, tmp_path, nproc, sig):
    """SIGTERM (to the learner) or Ctrl-C (SIGINT to its whole process group, as a terminal sends
    it) is a clean stop on any rank count: exit 0, no traceback, a checkpoint whose weights file
    is the same whatever the rank count (no second copy of the tied embedding), and no warning
    about a second learner when the learner itself leaves the group (issue 40)."""
    asyncio.run(publish(bus, group("c", size=2, rewards=[1.0, 0.0])))
    cmd = [sys.executable, "-m", "streamrl", "learner", "--bootstrap-servers", bus_config.bootstrap_servers,
           f"bus.topic_prefix={bus_config.topic_prefix}", "learner.lr=0.001",
           "learner.groups_per_mini_batch=1", "learner.mini_batches_per_version=2",
           f"learner.checkpoint_dir={tmp_path / 'ckpt'}", f"learner.weights_dir={tmp_path / 'w'}",
           "metrics.host=127.0.0.1", "learner.end_with_data=false",  # its records are the test's, not a feed's
           f"learner.parallel.nproc={nproc}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = int(next(m for m in (re.search(r"metrics: http://[\d.]+:(\d+)/", line) for line in proc.stdout)
                        if m).group(1))
        deadline = time.monotonic() + 60
        trained = 0.0
        while time.monotonic() < deadline and trained < 2:
            time.sleep(0.3)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
            m = re.search(r'streamrl_learner_records_total\{outcome="trained"\} ([\d.]+)', text)
            trained = float(m.group(1)) if m else 0.0
        assert trained == 2, "the learner did not train the group"
        assert "streamrl_learner_staleness_seconds_bucket" in text
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches every process of the group
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "learner: stopped, version 0" in out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert "partitions revoked" not in out and "second learner" not in out, out
    latest = resume.latest(tmp_path / "ckpt")
    state = resume.load_state(latest)
    assert state.version == 0 and state.mini_batches == 1 and state.trained_records == 2
    from safetensors import safe_open

    with safe_open(str(latest / "policy" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: one copy


def test_restart_from_an_older_checkpoint_starts_a_new_line_and_drops_the_abandoned_one(memory_bus, tmp_path):
    """The newest checkpoint is damaged: the learner falls back to the previous one (version 1)
    while the policy topic already announced version 2. It starts a new line at version 1, says
    so on the policy topic, and drops records generated by version 2 of the abandoned line;
    version-1 records of the old line (the same weights) still train."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, mini_batches_per_version=1, versions=2,
                      keep_checkpoints=3, max_staleness=3)

    async def first_life():
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, group("a1") + group("a2", version=1))
        return learner, await asyncio.wait_for(task, 60)

    first, state = asyncio.run(first_life())
    assert state.version == 2
    old_line = state.lineage
    newest = resume.latest(cfg.checkpoint_dir)
    (newest / "state.json").write_text("{ torn")  # a crash mid-write of a disk that lied

    async def second_life():
        learner = Learner(bus, replace(cfg, versions=4))
        assert learner.version == 1 and learner.resumed_from != newest  # the fallback
        task = asyncio.create_task(learner.run())
        await wait_for(lambda: learner.state.lineage != old_line, what="a new line")
        abandoned = [replace(r, lineage=old_line) for r in group("b-old-v2", version=2)]
        same_weights = [replace(r, lineage=old_line) for r in group("b-old-v1", version=1)]
        new_line = [replace(r, lineage=learner.state.lineage) for r in group("b-new-v1", version=1)]
        await publish(bus, abandoned + same_weights + new_line)
        return learner, await asyncio.wait_for(task, 60)

    second, state = asyncio.run(second_life())
    assert state.version == 4 and state.abandoned == {old_line: 1}
    dead = letters(asyncio.run(read_topic(bus, "deadletter", 2, timeout_s=20)))
    assert sorted(d.record_id for d in dead) == ["b-old-v2-0", "b-old-v2-1"]
    assert {d.reason for d in dead} == {"abandoned_line"}
    # a1 before the fallback checkpoint; then a2 again (it came after it), b-old-v1 and b-new-v1
    assert state.trained_records == 2 + 2 + 4
    announced = policies(asyncio.run(read_topic(bus, "policy", 7, timeout_s=20)))
    lines = [(p.version, p.lineage) for p in announced]
    assert lines[:4] == [(0, old_line), (1, old_line), (2, old_line), (1, state.lineage)]
    assert lines[4:] == [(2, state.lineage), (3, state.lineage), (4, state.lineage)]


def test_one_rule_names_the_current_policy():
    """The highest version of a line wins (a record read again never steps a follower back);
    a new line wins whatever its number (a learner restarted from an older checkpoint)."""
    from streamrl.learner.versions import supersedes

    def v(n: int, line: str = "a") -> PolicyVersion:
        return PolicyVersion(version=n, lineage=line)

    assert supersedes(v(0), None)
    assert supersedes(v(3), v(2)) and not supersedes(v(2), v(3)) and not supersedes(v(3), v(3))
    assert supersedes(v(1, "b"), v(5, "a"))


def test_one_bounds_check_for_every_reward():
    from streamrl.errors import Failure
    from streamrl.records import RecordError
    from streamrl.reward.bounds import check_reward

    check_reward(1e6, 1e6, "reward.max_abs_reward")
    for value, reason in ((float("nan"), "non_finite_reward"), (1e39, "non_finite_reward"),
                          (-2.0, "reward_out_of_range")):
        with pytest.raises(Failure) as caught:
            check_reward(value, 1.0, "learner.max_abs_reward", error=RecordError)
        assert caught.value.reason == reason and isinstance(caught.value, RecordError)


@pytest.mark.parametrize("estimator, loss_mode, agg", [
    *[(e, "vanilla", "token-mean") for e in ("grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus",
                                            "reinforce_plus_plus_baseline", "ppo")],
    *[("grpo", m, a) for m, a in (("gspo", "seq-mean-token-mean"), ("clip_cov", "token-mean"),
                                  ("kl_cov", "token-mean"), ("geo_mean", "token-mean"), ("cispo", "token-sum"),
                                  ("gpg", "seq-mean-token-sum"), ("sapo", "token-mean"),
                                  ("dppo_tv", "seq-mean-token-sum-norm"), ("dppo_kl", "token-mean"),
                                  ("gvpo", "token-mean"))]])
def test_every_estimator_and_loss_trains_a_step(tmp_path, estimator, loss_mode, agg):
    """Issue 37: each of verl's estimators and losses, by its config name, moves the weights by
    a finite step on real token ids (their maths is checked against verl in test_learner_parity)."""
    from streamrl.learner.samples import to_sample
    from streamrl.learner.trainer import Trainer

    cfg = learner_cfg(tmp_path, adv_estimator=estimator, loss_agg_mode=agg, micro_batch_size=3)
    cfg.policy_loss.loss_mode = loss_mode
    cfg.validate()
    trainer = Trainer(cfg)
    records = group("a", size=3, rewards=[1.0, 0.0, 0.5]) + group("b", size=3, rewards=[0.0, 0.0, 1.0])
    samples = [to_sample(r, cfg, trainer.model.config.vocab_size, trainer.tokenizer) for r in records]
    before = params(trainer.model)
    out = trainer.step(samples)
    after = params(trainer.model)
    assert all(np.isfinite(v) for v in out.values()), out
    assert max((after[k] - before[k]).abs().max() for k in before) > 0, "the step moved nothing"


def test_kl_in_the_reward_with_an_adaptive_coefficient(tmp_path):
    """verl's use_kl_in_reward: the reference is kept, each step reports the KL penalty and its
    coefficient, and the adaptive controller moves the coefficient once the policy has moved."""
    from streamrl.learner.samples import to_sample
    from streamrl.learner.trainer import Trainer

    cfg = learner_cfg(tmp_path, use_kl_in_reward=True, kl_penalty="low_var_kl", lr=0.05)
    cfg.kl_ctrl.type, cfg.kl_ctrl.kl_coef, cfg.kl_ctrl.horizon = "adaptive", 0.1, 10
    trainer = Trainer(cfg.validate())
    records = group("k", size=3, rewards=[1.0, 0.0, 0.5])
    samples = [to_sample(r, cfg, trainer.model.config.vocab_size, trainer.tokenizer) for r in records]
    first = trainer.step(samples)
    assert first["reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    assert first["reward_kl_penalty_coeff"] == 0.1
    second = trainer.step(samples)
    assert second["reward_kl_penalty"] > 0 and trainer.kl_ctrl.value != 0.1, (second, trainer.kl_ctrl)


def test_a_stream_of_flat_groups_waits_with_a_named_reason_and_resumes(memory_bus, tmp_path):
    """Dynamic sampling without a bound: while every group is flat the learner filters them
    all (dead letters ``filtered``) and says it waits on groups with variance; the first groups
    with variance make the version."""
    cfg = learner_cfg(tmp_path, versions=1, groups_per_mini_batch=2)
    cfg.filter_groups.enable, cfg.filter_groups.metric = True, "acc"
    waiting = metrics.STAGE_WAITING.labels("learner", "filtered_groups")

    async def go():
        learner = Learner(memory_bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(memory_bus, group("f1", rewards=[1.0, 1.0]) + group("f2", rewards=[0.0, 0.0]))
        await wait_for(lambda: waiting._value.get() == 1, what="the learner to wait on filtered groups")
        assert learner.version == 0 and learner.assembler.filtered == 2
        await publish(memory_bus, group("m1", rewards=[1.0, 0.0]) + group("m2", rewards=[0.0, 1.0]))
        return await asyncio.wait_for(task, 60)

    state = asyncio.run(go())
    assert state.version == 1 and state.trained_records == 4
    pols = policies(asyncio.run(read_topic(memory_bus, "policy", 2)))
    assert pols[-1].metrics["filtered_groups"] == 2.0
    dls = letters(asyncio.run(read_topic(memory_bus, "deadletter", 4)))
    assert sorted(d.record_id for d in dls if d.reason == "filtered") == ["f1-0", "f1-1", "f2-0", "f2-1"]


def test_partitions_revoked_warns_of_a_second_learner_only_while_running(memory_bus, tmp_path, caplog):
    """A rebalance while the learner runs is worth a warning (another member in its group); the
    revocation of its own leaving is not (issue 40: every clean exit cried wolf)."""
    from streamrl.bus import TopicPartition

    learner = Learner(memory_bus, learner_cfg(tmp_path))
    revoked = {TopicPartition("rewarded", 0)}
    with caplog.at_level("WARNING", logger="streamrl.learner.stage"):
        learner._revoked(revoked)
        assert "is a second learner in group" in caplog.text
        caplog.clear()
        stop = asyncio.Event()
        stop.set()
        asyncio.run(learner.run(stop=stop))  # starts, stops at once, leaves its group
        learner._revoked(revoked)  # what the consumer's leaving calls
    assert "second learner" not in caplog.text
