"""Issue 48's parts in the learner (their maths is checked against verl in
``test_learner_parity_extra.py``): the learning-rate schedule over versions and across a
resume; rollout correction and the critic exact over micro-batches (the critic also on two
FSDP2 ranks, resumed on another rank count); GDPO's components from reward_info; ReMax's greedy
baseline through the rollout worker, the topics' schemas and the learner; and one end-to-end
run (ReMax + rollout correction + a cosine lr) on the real broker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from streamrl import resume
from streamrl.learner import schedule
from streamrl.learner.config import LearnerConfig
from streamrl.learner.stage import Learner
from streamrl.records import PolicyVersion
from tests.learner import verl_parity_extra_data
from tests.helpers import group, learner_cfg, publish, read_topic, wait_for

DATA = json.loads(verl_parity_extra_data.DATA)


def verl(key: str, value) -> dict:
    """What verl's ``key=value`` sets here (``streamrl.verl``' table)."""
    from streamrl.verl import MAPPED, read_verl_keys

    [outcome] = read_verl_keys([(key, value)])
    assert outcome.kind == MAPPED, (key, outcome.kind, outcome.why)
    return outcome.sets


@pytest.mark.parametrize("sched", DATA["schedules"], ids=lambda s: "{lr_scheduler_type}-{lr_warmup_steps}-"
                         "{lr_warmup_steps_ratio}-{min_lr_ratio}-{num_cycles}-{versions}".format(**s))
def test_the_lr_at_each_version_equals_verls_scheduler(sched):
    """verl's scheduler steps once per training step, the first update at step 0: the update
    towards version v + 1 uses verl's rate after v steps."""
    keys = ("lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio", "num_cycles",
            "versions", "lr")
    cfg = LearnerConfig(**{k: sched[k] for k in keys}).validate()
    ours = [schedule.lr_at(cfg, v) for v in range(sched["versions"] + 1)]
    assert ours == pytest.approx(sched["lrs"], rel=1e-12, abs=1e-15)


def test_verls_optim_keys_map_and_a_schedule_that_needs_a_total_asks_for_versions():
    prefix = "actor_rollout_ref.actor.optim."
    for key, value in (("lr_scheduler_type", "cosine"), ("lr_warmup_steps", 3), ("lr_warmup_steps_ratio", 0.1),
                       ("min_lr_ratio", 0.1), ("num_cycles", 1.5)):
        assert verl(prefix + key, value) == {f"learner.{key}": value}
    assert verl(prefix + "warmup_style", "cosine") == {"learner.lr_scheduler_type": "cosine"}
    from streamrl.errors import ConfigError

    with pytest.raises(ConfigError, match="learner.versions"):  # an open run: no total
        LearnerConfig(lr_scheduler_type="cosine", end_with_data=False).validate()
    LearnerConfig(lr_scheduler_type="cosine").validate()  # the data's, counted at start (test_learner_optim.py)
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        LearnerConfig(lr_scheduler_type="linear").validate()
    LearnerConfig(lr_warmup_steps=3).validate()  # a constant warm-up needs no total


def test_the_schedule_runs_by_version_and_carries_across_a_resume(memory_bus, tmp_path):
    """Cosine with a warm-up over 4 versions: versions 1-2 in a first life, 3-4 after a restart
    from its checkpoint; each version's announced lr is verl's at that step."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, versions=4, lr_scheduler_type="cosine",
                      lr_warmup_steps=1, min_lr_ratio=0.1)

    async def life(groups, until, version):
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, [r for g in groups for r in group(g, version=version)])
        if until == cfg.versions:  # the second life ends by itself at learner.versions
            await asyncio.wait_for(task, 120)
            return
        await wait_for(lambda: learner.version >= until and learner.last_checkpoint
                       and resume.load_state(learner.last_checkpoint).version >= until, what=f"v{until}")
        task.cancel()  # the first life is killed after its checkpoint
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(life(["s1", "s2"], 2, 0))
    asyncio.run(life(["s3", "s4"], 4, 2))
    announced = {p.version: p.metrics["lr"] for p in map(PolicyVersion.decode,
                                                        (m.value for m in asyncio.run(read_topic(bus, "policy"))))
                 if p.version}  # (version 0: the initial weights, announced at start)
    assert sorted(announced) == [1, 2, 3, 4]
    want = [schedule.lr_at(cfg, v) for v in range(4)]
    assert [announced[v + 1] for v in range(4)] == pytest.approx(want, rel=1e-6)
    assert want[0] == 0.0 and want[1] == cfg.lr and want[3] < want[2] < cfg.lr


# -- rollout correction --------------------------------------------------------------------------

CORRECTIONS = {
    "decoupled-token-norm-rs": dict(rollout_is="token", rollout_is_threshold="1.2", rollout_is_batch_normalize=True,
                                    rollout_rs="seq_mean_k3", rollout_rs_threshold="0.045"),
    "decoupled-sequence-icepop": dict(rollout_is="sequence", rollout_is_threshold="0.01_100",
                                      rollout_is_batch_normalize=True),
    "bypass-reinforce": dict(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold="1.2",
                             rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    "bypass-reinforce-sequence-norm": dict(bypass_mode=True, loss_type="reinforce", rollout_is="sequence",
                                           rollout_is_threshold="3.0", rollout_is_batch_normalize=True),
    "bypass-ppo_clip": dict(bypass_mode=True, rollout_rs="seq_max_k2,token_k3", rollout_rs_threshold="0.5,0.05"),
}


def corrected_cfg(tmp_path, name: str, **kw) -> LearnerConfig:
    c = learner_cfg(tmp_path, trainer=True, **kw)
    for k, v in CORRECTIONS[name].items():
        setattr(c.rollout_correction, k, v)
    return c.validate()


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_rollout_correction_is_exact_over_micro_batches(tmp_path, name):
    """One sequence a forward pass, padded, against eight a pass, packed: the same loss,
    gradient norm, gradients and rollout_corr/* figures (the weights, rejection
    and batch normaliser are the mini-batch's, as verl's on its batch)."""
    import torch

    from streamrl.learner.trainer import Trainer
    from tests.helpers import batch

    outs, states = [], []
    for mb, packed in ((1, False), (8, True)):
        torch.manual_seed(0)
        trainer = Trainer(corrected_cfg(tmp_path, name, micro_batch_size=mb, use_remove_padding=packed))
        outs.append(trainer.step(batch(3)))
        states.append({k: p.grad.detach().clone() for k, p in trainer.model.named_parameters()})
    one, many = outs
    assert any(k.startswith("rollout_corr/rollout_rs") for k in one) == bool(CORRECTIONS[name].get("rollout_rs"))
    assert 0 < one.get("rollout_corr/rollout_rs_masked_fraction", 0.5) < 1, one  # some rejected, not all
    for k in ("loss", "pg_loss", "grad_norm", *[k for k in one if k.startswith("rollout_corr/")]):
        assert many[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-7, msg=k)


def test_rollout_correction_keys_and_what_is_refused():
    from streamrl.errors import ConfigError

    for key in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                "rollout_rs_threshold", "bypass_mode", "loss_type"):
        assert verl(f"algorithm.rollout_correction.{key}", 1) == {f"learner.rollout_correction.{key}": 1}
    for bad, match in ((dict(rollout_is="tokens"), "rollout_is"), (dict(rollout_rs="token_k4", rollout_rs_threshold="1"),
                                                                   "rollout_rs"),
                       (dict(rollout_rs="token_k2"), "rollout_rs_threshold"),
                       (dict(rollout_is="token", rollout_is_threshold="2_1"), "rollout_is_threshold"),
                       (dict(bypass_mode=True, loss_type="pg"), "loss_type")):
        c = LearnerConfig()
        for k, v in bad.items():
            setattr(c.rollout_correction, k, v)
        with pytest.raises(ConfigError, match=match):
            c.validate()
    c = LearnerConfig(decoupled=True)
    c.rollout_correction.rollout_is = "token"
    with pytest.raises(ConfigError, match="decoupled"):
        c.validate()
    c = LearnerConfig()
    c.rollout_correction.bypass_mode, c.policy_loss.loss_mode = True, "gspo"
    assert "loss_type ppo_clip" in c.validate().start_notes()[0]


# -- GDPO ----------------------------------------------------------------------------------------

def test_gdpo_reads_its_components_from_reward_info_and_reports_them(tmp_path):
    """A scorer's dict result puts its fields in reward_info: adv_estimator gdpo trains on
    the named ones (verl's gdpo/<key>/mean, std figures), and a record without one is refused
    alone, naming the field."""
    from streamrl.errors import ConfigError
    from streamrl.learner.samples import to_sample
    from streamrl.learner.distributed import decode_samples, encode_samples
    from streamrl.learner.trainer import Trainer
    from streamrl.records import RecordError

    with pytest.raises(ConfigError, match="gdpo_reward_keys"):
        learner_cfg(tmp_path, adv_estimator="gdpo").validate()
    with pytest.raises(ConfigError, match="gdpo_reward_weights"):
        learner_cfg(tmp_path, adv_estimator="gdpo", gdpo_reward_keys=["a"], gdpo_reward_weights=[1, 2]).validate()
    assert verl("algorithm.gdpo_reward_keys", ["a"]) == {"learner.gdpo_reward_keys": ["a"]}
    cfg = learner_cfg(tmp_path, adv_estimator="gdpo", gdpo_reward_keys=["format", "acc"],
                      gdpo_reward_weights=[0.5, 1.0], micro_batch_size=2).validate()
    trainer = Trainer(cfg)
    records = group("a", size=3) + group("b", size=3)
    for i, r in enumerate(records):
        r.reward_info = {"format": i % 2 == 0, "acc": float(i % 3) / 2, "status": "ok"}
    samples = [to_sample(r, cfg, trainer.model.config.vocab_size, trainer.tokenizer) for r in records]
    assert samples[0].reward_components == [1.0, 0.0] and samples[5].reward_components == [0.0, 1.0]
    assert decode_samples(encode_samples(samples))[5].reward_components == [0.0, 1.0]  # to the other ranks
    out = trainer.step(samples)
    assert out["gdpo/format/mean"] == pytest.approx(0.5) and out["gdpo/acc/std"] > 0
    records[0].reward_info = {"format": 1.0}
    with pytest.raises(RecordError, match="acc") as caught:
        to_sample(records[0], cfg, trainer.model.config.vocab_size, trainer.tokenizer)
    assert caught.value.reason == "no_reward_component"


# -- ReMax ---------------------------------------------------------------------------------------

def test_remax_greedy_baseline_travels_with_its_group_and_is_never_trained_on(memory_bus, tmp_path):
    """The rollout worker adds one greedy response marked ``baseline`` to each group (the
    group's size counts it; its id is its own); the record passes the topics' schemas; the
    learner trains the other members only, each with the baseline's reward as its baseline."""
    from streamrl.learner.stage import Learner, remax_baselines
    from streamrl.pipeline_config import load_config
    from streamrl.records import Prompt, Rewarded, Trajectory
    from streamrl.rollout.config import RolloutConfig
    from streamrl.rollout.worker import RolloutWorker

    remax = load_config("local.yaml", ["learner.adv_estimator=remax"])
    # the gate counts each group's baseline: a version's 16 groups of 16 still fit under its bound
    assert remax.rollout.greedy_baseline and remax.rollout.trajectories_per_version == 16 * 17
    worker = RolloutWorker(memory_bus, RolloutConfig(group_size=3, greedy_baseline=True, max_new_tokens=6,
                                                     follow_policy=False))
    prompt = Prompt(group_id="p1", group_size=3, data_source="test", prompt="12+3=")
    out = asyncio.run(worker.handle(prompt, None))
    assert len(out) == 4 and all(t.group_size == 4 for t in out)
    [base] = [t for t in out if t.baseline]
    assert base.id == "p1-baseline" and len({t.id for t in out}) == 4
    again = asyncio.run(worker.handle(prompt, None))  # greedy: the same response again
    assert [t.response for t in again if t.baseline] == [base.response]
    assert Trajectory.decode(base.encode()).baseline is True  # valid against topics/rollouts.json
    assert "baseline" not in out[0].encode().decode()  # a sample carries no such field
    scored = Rewarded.from_trajectory(base, reward=0.25, reward_info={}, scorer={"name": "t"})
    assert Rewarded.decode(scored.encode()).baseline is True  # ... and topics/rewarded.json

    cfg = learner_cfg(tmp_path, adv_estimator="remax", groups_per_mini_batch=1, versions=1)
    records = group("r", size=4, rewards=[1.0, 0.0, 1.0, 0.5])
    records[3].baseline = True
    seen = []
    learner = Learner(memory_bus, cfg)
    real_step = learner.trainer.step
    learner.trainer.step = lambda samples: seen.append(list(samples)) or real_step(samples)

    async def run():
        task = asyncio.create_task(learner.run())
        await publish(memory_bus, records)
        await asyncio.wait_for(task, 60)

    asyncio.run(run())
    [trained] = seen
    assert sorted(s.id for s in trained) == ["r-0", "r-1", "r-2"]
    assert all(s.reward_baseline == 0.5 for s in trained)
    adv = learner.trainer.advantages(trained, [np.ones(len(s.response_ids), np.float32) for s in trained])
    assert [float(a[0]) for a in adv] == pytest.approx([0.5, -0.5, 0.5])
    assert remax_baselines([[]], True) == []


# -- the critic (adv_estimator gae) --------------------------------------------------------------

def critic_cfg(tmp_path, **kw) -> LearnerConfig:
    """GAE with a critic, plus the decoupled rollout correction (batch-normalised weights and a
    rejection) and a warm-up/cosine lr: every path of issue 48 that talks between ranks."""
    c = corrected_cfg(tmp_path, "decoupled-token-norm-rs", adv_estimator="gae", gamma=0.99, lam=0.95, versions=6,
                      lr_scheduler_type="cosine", lr_warmup_steps=1, **kw)
    c.critic.lr, c.critic.cliprange_value = 1e-3, 0.2
    return c.validate()


def test_the_critic_is_exact_over_micro_batches_and_learns(tmp_path):
    """One sequence a pass against eight: the same value loss, critic gradients and metrics;
    over a few steps on the same data its loss falls."""
    import torch

    from streamrl.learner.trainer import Trainer
    from tests.helpers import batch

    outs, grads = [], []
    for mb in (1, 8):
        torch.manual_seed(0)
        trainer = Trainer(critic_cfg(tmp_path, micro_batch_size=mb))
        trainer.set_version(1)
        outs.append(trainer.step(batch(3)))
        grads.append({k: p.grad.clone() for k, p in trainer.critic.model.named_parameters()})
    for k in [k for k in outs[0] if k.startswith("critic/")] + ["loss", "grad_norm"]:
        assert outs[1][k] == pytest.approx(outs[0][k], rel=1e-4, abs=1e-6), k
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-7, msg=k)
    losses_seen = [outs[1]["critic/vf_loss"]] + [trainer.step(batch(3))["critic/vf_loss"] for _ in range(4)]
    assert losses_seen[-1] < 0.7 * losses_seen[0], losses_seen


def _rank(rank: int, world: int, port: int, tmp: str, resume: str) -> None:
    """Rank 1 follows; rank 0 resumes from ``resume`` (written by one process), trains two
    mini-batches at version 1 and writes a checkpoint."""
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from pathlib import Path

    from streamrl.learner import distributed
    from streamrl.learner.trainer import Trainer
    from tests.helpers import batch, follow_then_exit

    c = critic_cfg(Path(tmp))
    if rank:
        follow_then_exit(c)
    trainer = Trainer(c, resume=resume)
    trainer.set_version(1)
    outs = [trainer.step(batch(seed)) for seed in (1, 2)]
    (Path(tmp) / "ckpt2").mkdir()
    trainer.write_checkpoint(Path(tmp) / "ckpt2")
    (Path(tmp) / "out.json").write_text(json.dumps(outs))
    distributed.finish()


def test_the_critic_on_two_ranks_matches_one_and_resumes_on_another_rank_count(tmp_path):
    """1 rank -> 2 FSDP2 ranks -> 1: the two ranks resume the one-rank checkpoint (critic
    weights and AdamW states), train as one process does (policy and critic losses, rollout
    correction figures, lr), and their sharded checkpoint loads back into one process with the
    critic's state of the one-process run."""
    import torch
    import torch.multiprocessing as mp

    from streamrl.learner.trainer import Trainer
    from streamrl.net import free_port
    from tests.helpers import batch

    torch.manual_seed(0)
    one = Trainer(critic_cfg(tmp_path))
    one.set_version(0)
    one.step(batch(0))
    (tmp_path / "ckpt1").mkdir()
    one.write_checkpoint(tmp_path / "ckpt1")
    assert (tmp_path / "ckpt1" / "critic_dcp" / ".metadata").is_file()
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path), str(tmp_path / "ckpt1")), nprocs=2, join=True)
    two = json.loads((tmp_path / "out.json").read_text())
    one.set_version(1)
    want = [one.step(batch(seed)) for seed in (1, 2)]
    keys = ["loss", "grad_norm", "lr", "critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var",
            "rollout_corr/rollout_is_batch_norm_factor", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl"]
    for got, exp in zip(two, want):
        for k in keys:
            assert got[k] == pytest.approx(exp[k], rel=1e-4, abs=1e-6), (k, got[k], exp[k])
    back = Trainer(critic_cfg(tmp_path), resume=str(tmp_path / "ckpt2"))
    for (name, p), q in zip(one.critic.model.named_parameters(), back.critic.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(back.critic.optimizer.state[q]["exp_avg"], one.critic.optimizer.state[p]["exp_avg"],
                                   rtol=1e-3, atol=1e-7, msg=name)


# -- end to end ------------------------------------------------------------------------------------

#: PPO with a critic, verl's rollout correction and a warm-up/cosine lr, as verl's keys say them
#: (the critic at the actor's lr: verl's 1e-5 is for 7B models, not the tiny policy), two versions
#: of critic warm-up, and the ``remax`` recipe's guard: no entropy bonus (verl's default) and verl's
#: KL loss to the reference. With local.yaml's bonus and no KL loss, 2 runs of 8 (CI's, and one
#: here with the warm-up too) fell to reward 0 by version 4 and never came back: the end of
#: sequence took the second digit's place, then the first's (docs/guides/objective.md)
E2E = ["algorithm.adv_estimator=gae", "algorithm.lam=1.0", "critic.optim.lr=0.002", "critic.cliprange_value=0.5",
       "trainer.critic_warmup=2", "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=True",
       "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.kl_loss_coef=0.1",
       "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
       "algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.05",
       "actor_rollout_ref.actor.optim.lr_warmup_steps=2", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
       "actor_rollout_ref.actor.optim.min_lr_ratio=0.5"]


@pytest.mark.e2e
@pytest.mark.timeout(800)
def test_ppo_with_a_critic_rollout_correction_and_a_cosine_lr_learn_end_to_end(tmp_path):
    """``streamrl run`` on the real broker, the embedded default's digits task, with a verl PPO
    script's keys: the learner trains a critic beside the policy (critic/* figures, its shards in
    every checkpoint; the critic alone for the first two versions), corrects each mini-batch as
    verl's rollout correction does (rollout_corr/*), follows verl's lr schedule, and the reward
    climbs. (ReMax's greedy baseline through the stages:
    ``test_remax_greedy_baseline_travels_with_its_group_and_is_never_trained_on``.)"""
    import subprocess
    import sys

    from tests.helpers import ROOT, last_json_line

    versions = 40
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "run", "configs/local.yaml", f"run.out_dir={tmp_path}",
                             "run.reward_members=1", f"learner.versions={versions}", "feed.limit=800",
                             "feed.dataset=digits:rev", *E2E], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=780)
    assert proc.returncode == 0, err[-3000:]
    summary = last_json_line(out)
    assert summary["ended"] == "done" and summary["versions"] == versions, summary
    by_version = [r for _, r in sorted((int(v), r) for v, r in summary["reward_by_version"].items())]
    first, last = sum(by_version[:3]) / 3, sum(by_version[-5:]) / 5
    # RL at 40 versions on 2 shared cores is noisy: three runs of these settings climbed by 0.19, 0.38
    # and 0.70 (the mean of the last five over the first three); two of them dipped to 0.002 and 0.03
    # at version 4, the fall above, and the KL loss brought them back
    assert last >= first + 0.04, by_version
    latest = resume.latest(Path(summary["out"]) / "checkpoints")
    state = resume.load_state(latest)
    assert state.version == versions and (latest / "critic_dcp" / ".metadata").is_file()
    figures = state.summary
    # the policy's schedule starts at its first update (version 1 after two versions of warm-up)
    assert figures["lr"] == pytest.approx(schedule.lr_at(LearnerConfig(lr=0.002, versions=versions, lr_warmup_steps=2,
                                                                       lr_scheduler_type="cosine", min_lr_ratio=0.5),
                                                          versions - 2), rel=1e-6)
    assert {"critic/vf_loss", "critic/vf_explained_var", "critic/vpred_mean", "critic/vf_clipfrac",
            "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl", "kl"} <= set(figures)
    assert figures["critic_warmup"] == 0.0  # (the stage's first two updates, the critic's alone, took no policy figures)


#: ReMax with the bench's ``remax`` recipe, in verl's keys: no entropy bonus (verl's default) and
#: verl's KL loss to the reference (without them ReMax's reward fell to 0 on this task:
#: docs/guides/objective.md)
REMAX = ["algorithm.adv_estimator=remax", "actor_rollout_ref.actor.entropy_coeff=0",
         "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
         "actor_rollout_ref.actor.kl_loss_coef=0.1"]


@pytest.mark.e2e
@pytest.mark.timeout(700)  # 312 s on a machine as slow as CI's last
def test_remax_keeps_its_reward_end_to_end(tmp_path):
    """``streamrl run`` on the real broker, the embedded default's digits task, with ReMax and
    the ``remax`` recipe's settings: the greedy baselines go through the stages with their groups
    (each version trains 16 groups of 16 samples and their greedy response), and the reward
    holds instead of falling to 0 as it did with ``local.yaml``'s settings (0.10 at version 0,
    0.0 from version 1 on). Whether it climbs in 20 versions is run to run (four runs: the mean
    of the last 10 versions over the first 3, +0.03, +0.06, -0.02, -0.04), so this asserts no
    fall to 0."""
    import subprocess
    import sys

    from tests.helpers import ROOT, last_json_line

    versions = 20
    proc = subprocess.run([sys.executable, "-m", "streamrl", "run", "configs/local.yaml", f"run.out_dir={tmp_path}",
                           "run.reward_members=1", f"learner.versions={versions}", "feed.limit=400",
                           "feed.dataset=digits:rev", *REMAX], cwd=ROOT, capture_output=True, text=True, timeout=680)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["ended"] == "done" and summary["versions"] == versions, summary
    by_version = [r for _, r in sorted((int(v), r) for v, r in summary["reward_by_version"].items())]
    first, later = sum(by_version[:3]) / 3, sum(by_version[-10:]) / 10
    # four runs: later / first 1.36, 2.3, 0.75 and (CI, 0.035 over 0.077) 0.45; the fall this guards
    # against ends at 0.00 (local.yaml's settings, and without the KL loss 1 run of 3 at lr 2e-3
    # from version 1, and a run at lr 5e-4 from version 15), so the bounds sit between the two
    assert later >= 0.25 * first and sum(by_version[-5:]) / 5 >= 0.015, by_version
    records = summary["records"]
    assert records["rewarded"] == records["rollouts"] and records["trained"] == versions * 16 * 17, records


def test_verls_ppo_remax_rollout_correction_and_schedule_scripts_train_what_they_say(tmp_path):
    """verl's own example scripts (``tests/data/verl_scripts.json``), once refused for want of
    issue 48, resolve to its parts: PPO's critic keys, ReMax's greedy baseline, the rollout
    correction example (bypass, REINFORCE, sequence weights batch-normalised), GSPO's warm-up."""
    from tests.helpers import resolved_script

    def resolved(name: str):
        return resolved_script(name, tmp_path)

    ppo = resolved("ppo_deepseek7b")
    assert ppo.problems == []
    learner = ppo.cfg.learner
    assert learner.adv_estimator == "gae" and learner.critic.lr == 1e-5
    assert learner.critic.model == "deepseek-ai/deepseek-llm-7b-chat"
    remax = resolved("remax")  # (its KL in the reward on 8 learner ranks is refused apart)
    assert remax.cfg.learner.adv_estimator == "remax" and remax.cfg.rollout.greedy_baseline
    rc = resolved("rollout_correction")
    assert rc.problems == []
    c = rc.cfg.learner.rollout_correction
    assert (c.rollout_is, c.rollout_is_threshold, c.rollout_is_batch_normalize, c.bypass_mode, c.loss_type,
            c.rollout_rs) == ("sequence", "2.0", True, True, "reinforce", None)
    rc.cfg.learner.validate()
    gspo = resolved("gspo")
    assert gspo.problems == [] and gspo.cfg.learner.lr_warmup_steps_ratio == 0.05


#: a small PPO run with a critic on the digits task: 2 groups of 4 a version, 6 versions
CRITIC_RUN = ["configs/local.yaml", "run.reward_members=1", "feed.limit=48", "feed.group_size=4",
              "learner.groups_per_mini_batch=2", "rollout.trajectories_per_version=8", "learner.versions=6",
              "run.restart.backoff_s=0.5", "algorithm.adv_estimator=gae", "algorithm.lam=1.0",
              "critic.optim.lr=0.002"]


def critic_adam_steps(ckpt: Path) -> int:
    """The AdamW step count in a checkpoint's critic shards (``critic_dcp/``), read back as one file."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "critic_dcp"), str(ckpt.parent / "critic.pt"))
    state = torch.load(ckpt.parent / "critic.pt", weights_only=False)
    (ckpt.parent / "critic.pt").unlink()
    steps = {int(s["step"]) for s in state["optim"]["state"].values()}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.mark.e2e
@pytest.mark.timeout(800)  # two runs; 335 s on a machine as slow as CI's last, and 400 ran out there
def test_a_learner_with_a_critic_killed_resumes_on_two_ranks_with_the_critics_state(tmp_path):
    """``streamrl run`` with a critic (``adv_estimator: gae``) on one learner rank, SIGKILLed
    (its whole process group) after version 2's checkpoint on a broker that outlives it, then
    resumed with two FSDP2 ranks: the run ends at its last version and the critic's AdamW has
    taken every version's steps, those of the killed session included (a critic that started
    afresh on resume would count only the resumed session's)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from streamrl.broker import EmbeddedBroker
    from tests.helpers import ROOT, last_json_line

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            return subprocess.Popen([sys.executable, "-m", "streamrl", "run", *CRITIC_RUN, *args], cwd=ROOT,
                                    stdout=out, stderr=err, text=True, start_new_session=True)

    versions, epochs = 6, 4  # local.yaml's learner.ppo_epochs (critic.ppo_epochs 0 follows it), one mini-batch a version
    with EmbeddedBroker() as broker:
        common = ["--bootstrap-servers", broker.bootstrap, "bus.topic_prefix=critic", f"run.out_dir={tmp_path}"]
        first = start("first", *common)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and first.poll() is None:
                good = [g for c in tmp_path.glob("*/checkpoints") if (g := resume.latest_good(c))]
                if good and good[0][1].version >= 2:
                    break
                time.sleep(0.1)
            assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
                first.wait()
        run_dir = next(tmp_path.glob("*/checkpoints")).parent
        killed_at = resume.latest_good(run_dir / "checkpoints")[1].version
        assert critic_adam_steps(resume.latest(run_dir / "checkpoints")) == killed_at * epochs
        second = start("second", *common, "--resume", str(run_dir), "learner.parallel.nproc=2")
        second.wait(300)
    err = (tmp_path / "second.err").read_text()
    assert second.returncode == 0, err[-3000:]
    summary = last_json_line((tmp_path / "second.out").read_text())
    assert summary["ended"] == "done" and summary["versions"] == versions, summary
    assert 2 <= killed_at < versions, killed_at
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "2 ranks through torch.distributed.run" in log and "resumed from" in log
    last = resume.latest(run_dir / "checkpoints")
    state = resume.load_state(last)
    assert state.version == versions and {"critic/vf_loss", "critic/vpred_mean"} <= set(state.summary)
    assert critic_adam_steps(last) == versions * epochs
