"""The optimizer and its schedule with verl's meaning (issue 56): verl's ``optim.optimizer``,
``betas``, ``weight_decay``, ``override_optimizer_config`` built as verl's ``build_optimizer``
builds them, FSDP's cosine counted from 1 (``zero_indexed_step``) and Megatron's decay styles as
verl's Megatron scheduler steps them, against verl 0.9.1's own functions
(``verl_optim_parity_data.py``, written by ``verl_optim_parity.py``); the critic's own optimizer,
schedule and micro-batches; the schedule's total where the run's length is the data's."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.errors import ConfigError
from streamrl.learner import schedule
from streamrl.learner.config import LearnerConfig
from streamrl.learner.optimizer import build_optimizer
from tests.learner import verl_optim_parity_data

DATA = json.loads(verl_optim_parity_data.DATA)


def test_the_numbers_came_from_verl():
    assert DATA["verl"] == "0.9.1"
    assert {m["lr_decay_style"] for m in DATA["megatron"]} == {"constant", "linear", "cosine", "inverse-square-root",
                                                                "WSD"}
    assert {m["lr_wsd_decay_style"] for m in DATA["megatron"] if m["lr_decay_style"] == "WSD"} == \
        {"exponential", "linear", "cosine", "minus_sqrt"}


@pytest.mark.parametrize("case", DATA["optimizers"], ids=lambda c: f"{c['optimizer']}-{c['weight_decay']}")
def test_the_optimizer_is_the_one_verls_build_optimizer_builds(case):
    cfg = LearnerConfig(lr=1e-3, optimizer=case["optimizer"], betas=case["betas"], weight_decay=case["weight_decay"],
                        override_optimizer_config=case["override_optimizer_config"]).validate()
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    assert type(opt).__name__ == case["class"]
    group = {k: list(v) if isinstance(v, tuple) else v for k, v in opt.param_groups[0].items() if k != "params"}
    assert {k: group[k] for k in case["group"]} == case["group"]


@pytest.mark.parametrize("sched", DATA["cosine_one_indexed"], ids=lambda s: "{lr_warmup_steps}-{lr_warmup_steps_ratio}-"
                         "{min_lr_ratio}-{num_cycles}-{versions}".format(**s))
def test_cosine_counted_from_one_equals_verls(sched):
    keys = ("lr_scheduler_type", "zero_indexed_step", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio",
            "num_cycles", "versions", "lr")
    cfg = LearnerConfig(**{k: sched[k] for k in keys}).validate()
    assert [schedule.lr_at(cfg, v) for v in range(sched["versions"] + 1)] == pytest.approx(sched["lrs"], rel=1e-12,
                                                                                          abs=1e-15)


@pytest.mark.parametrize("sched", DATA["megatron"], ids=lambda s: "{lr_decay_style}-{lr_wsd_decay_style}-{lr_warmup_steps}-"
                         "{lr_warmup_steps_ratio}-{lr_decay_steps}".format(**s))
def test_megatrons_decay_styles_equal_verls_megatron_scheduler(sched):
    """verl's Megatron engine steps Megatron-Core's scheduler once per training step: the update
    towards version v + 1 uses its rate after v steps, for the policy and for the critic."""
    keys = ("lr_decay_style", "lr_warmup_steps", "lr_warmup_steps_ratio", "lr_warmup_init", "min_lr", "lr_decay_steps",
            "lr_wsd_decay_style", "lr_wsd_decay_steps", "versions", "lr")
    cfg = LearnerConfig(**{k: sched[k] for k in keys}).validate()
    assert [schedule.lr_at(cfg, v) for v in range(sched["versions"] + 1)] == pytest.approx(sched["lrs"], rel=1e-12,
                                                                                          abs=1e-15)
    critic = LearnerConfig(adv_estimator="gae", versions=sched["versions"])
    for k in keys[:-2]:
        setattr(critic.critic, k, sched[k])
    critic.critic.lr = sched["lr"]
    critic.validate()
    assert [schedule.lr_at(critic.critic, v, critic.versions) for v in range(sched["versions"] + 1)] == \
        pytest.approx(sched["lrs"], rel=1e-12, abs=1e-15)


def test_megatrons_names_and_what_is_refused_naming_the_field():
    adam = build_optimizer([torch.nn.Parameter(torch.zeros(1))], LearnerConfig(optimizer="adam", betas=[0.8, 0.9]))
    assert type(adam) is torch.optim.AdamW and adam.param_groups[0]["betas"] == (0.8, 0.9)  # decoupled decay
    sgd = build_optimizer([torch.nn.Parameter(torch.zeros(1))], LearnerConfig(optimizer="sgd"))
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.9  # Megatron's default
    for kw, field in ((dict(optimizer="muon"), "learner.optimizer"), (dict(optimizer="AdamW8bit"), "learner.optimizer"),
                      (dict(optimizer_impl="bitsandbytes.optim"), "learner.optimizer_impl"),
                      (dict(betas=[0.9]), "learner.betas"), (dict(lr_decay_style="exp"), "learner.lr_decay_style"),
                      (dict(lr_decay_style="linear", end_with_data=False), "learner.lr_decay_steps"),
                      (dict(lr_decay_style="WSD", versions=10), "learner.lr_wsd_decay_steps"),
                      (dict(lr_decay_style="cosine", versions=4, lr_warmup_steps=4), "learner.lr_warmup_steps"),
                      (dict(lr_decay_style="linear", versions=4, min_lr=1.0), "learner.min_lr")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.") + "'"):
            LearnerConfig(**kw).validate()
    bad_critic = LearnerConfig(adv_estimator="gae")
    bad_critic.critic.optimizer = "Lion"
    with pytest.raises(ConfigError, match=r"learner\.critic\.optimizer'"):
        bad_critic.validate()
    LearnerConfig(lr_decay_style="constant", lr_warmup_steps=3).validate()  # Megatron's constant needs no total


def test_the_trainer_and_the_critic_use_their_own_optimizers_and_schedules(tmp_path):
    """The policy's optimizer from learner.*, the critic's from learner.critic.*: its class,
    betas and weight decay, and its own schedule at each version."""
    from streamrl.learner.trainer import Trainer
    from tests.helpers import batch, learner_cfg

    cfg = learner_cfg(tmp_path, trainer=True, adv_estimator="gae", optimizer="Adam", betas=[0.8, 0.95],
                      weight_decay=0.0, versions=8, lr_scheduler_type="cosine")
    c = cfg.critic
    c.optimizer, c.betas, c.weight_decay, c.lr = "AdamW", [0.7, 0.9], 0.2, 1e-3
    c.lr_decay_style, c.lr_warmup_steps, c.min_lr = "linear", 2, 1e-4
    trainer = Trainer(cfg.validate())
    assert type(trainer.optimizer) is torch.optim.Adam and trainer.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    critic_group = trainer.critic.optimizer.param_groups[0]
    assert type(trainer.critic.optimizer) is torch.optim.AdamW
    assert (critic_group["betas"], critic_group["weight_decay"]) == ((0.7, 0.9), 0.2)
    for v in (1, 5):
        trainer.set_version(v)
        out = trainer.step(batch(v))
        assert out["lr"] == pytest.approx(schedule.lr_at(cfg, v), rel=1e-12)
        assert out["critic/lr"] == pytest.approx(schedule.lr_at(c, v, cfg.versions), rel=1e-12)
    assert out["critic/lr"] != pytest.approx(c.lr) and out["critic/lr"] != pytest.approx(out["lr"])


def test_the_critics_own_micro_batches_train_the_same(tmp_path):
    """learner.critic.micro_batch_size (verl's critic.ppo_micro_batch_size_per_gpu): the critic's
    forward passes are its own, one sequence each here, and its update is the one of the
    policy's micro-batches."""
    from streamrl.learner.trainer import Trainer
    from tests.helpers import batch, learner_cfg

    outs, passes = [], []
    for critic_mbs in (0, 1):
        torch.manual_seed(0)
        cfg = learner_cfg(tmp_path, trainer=True, adv_estimator="gae", micro_batch_size=8)
        cfg.critic.lr, cfg.critic.micro_batch_size = 1e-3, critic_mbs
        trainer = Trainer(cfg.validate())
        calls = []
        trainer.critic.model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0] if a else 0))
        outs.append(trainer.step(batch(3)))
        passes.append(len(calls))
    samples = len(batch(3))
    assert passes[1] == 2 * samples and passes[0] == 2 * (-(-samples // 8))  # values + one epoch of updates
    for k in [k for k in outs[0] if k.startswith("critic/")] + ["loss"]:
        assert outs[1][k] == pytest.approx(outs[0][k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("schedule_kw", [dict(lr_scheduler_type="cosine"), dict(lr_warmup_steps_ratio=0.5),
                                         dict(lr_decay_style="linear")], ids=["cosine", "warmup-ratio", "megatron"])
def test_a_run_that_ends_with_the_data_counts_the_schedules_total_as_verl(fmt, schedule_kw, memory_bus, tmp_path):
    """learner.versions 0 (verl's total_training_steps null): the schedule's total is the
    versions the feed's data makes, as verl counts its steps, len(train_dataloader) *
    total_epochs with its dataloader's drop_last, not the run's own length (its last version may
    be partial); counted at the learner's start from the dataset, sent to every rank."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from streamrl.feed.config import FeedConfig
    from streamrl.learner.stage import Learner
    from tests.helpers import dry_run, learner_cfg

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(11)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    epochs, per_version = 3, 4
    cfg = learner_cfg(tmp_path, trainer=True, groups_per_mini_batch=2, mini_batches_per_version=2, **schedule_kw)
    assert cfg.versions == 0 and cfg.end_with_data  # the config's check leaves the total to the start
    verls = len(DataLoader(list(range(len(rows))), batch_size=per_version, drop_last=True)) * epochs
    assert verls == 6 != -(-len(rows) * epochs // per_version)  # 2 a epoch; the run's own length is 9
    learner = Learner.from_config(SimpleNamespace(learner=cfg, feed=FeedConfig(dataset=str(path), epochs=epochs)),
                                  memory_bus)
    trainer = learner.trainer
    assert trainer.total == verls == schedule.data_versions(len(rows), epochs, per_version)
    # the dry-run says that total before the run, beside the versions the run trains
    code, out, err = dry_run([f"feed.dataset={path}", f"feed.epochs={epochs}", "learner.versions=0",
                              "learner.groups_per_mini_batch=2", "learner.mini_batches_per_version=2",
                              *(f"learner.{k}={v}" for k, v in schedule_kw.items())], tmp_path)
    assert code == 0, err
    assert "= 9 versions" in out and f"the lr schedule's total: {verls} versions" in out, out[-600:]
    for v in (1, 2, 4):
        trainer.set_version(v)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(schedule.lr_at(cfg, v, verls), rel=1e-12)
    assert schedule.lr_at(cfg, 2, verls) != pytest.approx(schedule.lr_at(cfg, 2, 9))
    # no data to count (a dataset this process cannot read) and no learner.versions: refused at start
    gone = SimpleNamespace(learner=cfg, feed=FeedConfig(dataset=str(tmp_path / "none.jsonl"), epochs=epochs))
    field = "learner.lr_decay_steps" if "lr_decay_style" in schedule_kw else "learner.versions"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + "'"):
        Learner.from_config(gone, memory_bus)
    # an open run (not ending with the data) has no total: refused when the config is checked
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + "'"):
        LearnerConfig(end_with_data=False, **schedule_kw).validate()
