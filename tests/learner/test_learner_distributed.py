"""The learner on several ranks (issue 25): FSDP2 over gloo on CPU, two real processes speaking
the real rank-0 protocol (``streamrl.learner.ranks.follow`` on rank 1), token-budget
micro-batches, sharded checkpoints written by N ranks and read by M."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from streamrl.errors import ConfigError
from streamrl.learner import microbatch
from streamrl.learner.config import KLControlConfig, LearnerConfig, ParallelConfig, PolicyLossConfig
from streamrl.learner.trainer import Trainer
from streamrl.net import free_port
from streamrl.policy import load_policy
from tests.helpers import PARITY, STEPS, batch, follow_then_exit, learner_cfg, parity_batch

#: this module's configs: the shared builder with the Trainer tests' step
cfg = functools.partial(learner_cfg, trainer=True)


def safetensors_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def local_state_bytes(trainer: Trainer) -> int:
    from streamrl.learner.distributed import local_bytes

    optim = [v for st in trainer.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return local_bytes(trainer.model.parameters()) + local_bytes(optim)


def _rank(rank: int, world: int, port: int, tmp: str, resume: str) -> None:
    """One of two ranks: rank 1 follows; rank 0 resumes from ``resume``, trains STEPS
    mini-batches, writes a checkpoint and reports losses, weights and memory."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from streamrl.learner import distributed

    c = cfg(Path(tmp), **PARITY)
    if rank:
        follow_then_exit(c)
    trainer = Trainer(c, resume=resume)
    trainer.save_weights(Path(tmp) / "resumed")  # gathered from the two ranks' shards
    assert trainer.packed  # the two ranks pack; the one-rank run they are compared with pads
    outs = [trainer.step(parity_batch(seed)) for seed in range(1, STEPS + 1)]
    memory = local_state_bytes(trainer)
    (Path(tmp) / "ckpt2").mkdir()
    trainer.write_checkpoint(Path(tmp) / "ckpt2")
    (Path(tmp) / "out.json").write_text(json.dumps({"losses": [o["loss"] for o in outs], "memory": memory,
                                                    "grad_norms": [o["grad_norm"] for o in outs]}))
    distributed.finish()


def test_two_fsdp_ranks_match_one_and_checkpoints_cross_rank_counts(tmp_path):
    """Two FSDP2 ranks, packed (the default), against one process, padded: the same losses,
    gradient norms and weights, and checkpoints that cross rank counts."""
    torch.manual_seed(0)
    one = Trainer(cfg(tmp_path, use_remove_padding=False, **PARITY))
    one.step(batch(0))
    ckpt1 = tmp_path / "ckpt1"
    ckpt1.mkdir()
    one.write_checkpoint(ckpt1)  # written by one process, resumed by two below
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path), str(ckpt1)), nprocs=2, join=True)
    out = json.loads((tmp_path / "out.json").read_text())

    # the published file is the same whatever the rank count (issue 40: 2 ranks wrote a second
    # copy of the tied embedding as lm_head.weight)
    assert safetensors_names(tmp_path / "resumed") == safetensors_names(ckpt1 / "policy")
    assert "lm_head.weight" not in safetensors_names(tmp_path / "resumed")
    resumed = load_policy(str(tmp_path / "resumed"))[0].state_dict()
    for name, value in one.model.state_dict().items():  # 1 -> 2 ranks: the same weights
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)
    memory_one = local_state_bytes(one)
    expected = [one.step(parity_batch(seed)) for seed in range(1, STEPS + 1)]
    for got, want in zip(out["losses"], [e["loss"] for e in expected]):
        assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (out["losses"], expected)
    for got, want in zip(out["grad_norms"], [e["grad_norm"] for e in expected]):
        assert abs(got - want) <= 1e-5 * want, (out["grad_norms"], expected)
    # 2 ranks -> 1: the sharded checkpoint's weights and AdamW moments are the 1-rank run's
    back = Trainer(cfg(tmp_path, use_remove_padding=False, **PARITY), resume=str(tmp_path / "ckpt2"))
    for (name, value), p in zip(one.model.state_dict().items(), back.model.state_dict().values()):
        torch.testing.assert_close(p, value, rtol=1e-5, atol=1e-5, msg=name)
    for p_one, p_back in zip(one.model.parameters(), back.model.parameters()):
        torch.testing.assert_close(back.optimizer.state[p_back]["exp_avg"], one.optimizer.state[p_one]["exp_avg"],
                                   rtol=1e-4, atol=1e-7)
    assert memory_one > 0 and out["memory"] <= 0.55 * memory_one, (out["memory"], memory_one)


#: KL in the reward (verl's algorithm.use_kl_in_reward), adaptive, with every path that talks
#: between ranks (PARITY: decoupled proximal log-probs, the sharded reference, a chunked sequence)
KL_IN_REWARD = dict(PARITY, kl_coef=0.0, use_kl_in_reward=True, kl_penalty="low_var_kl", adv_estimator="reinforce_plus_plus",
                    kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.001, horizon=16))


def _steps_rank(rank: int, world: int, port: int, tmp: str, name: str, seeds: list[int]) -> None:
    """One of two ranks trains the mini-batches of ``seeds`` with the settings ``RANK_SETTINGS[name]``
    names; rank 0 reports them to ``<name>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from streamrl.learner import distributed

    c = cfg(Path(tmp), **RANK_SETTINGS[name])
    if rank:
        follow_then_exit(c)
    trainer = Trainer(c)
    outs = [trainer.step(parity_batch(seed)) for seed in seeds]
    (Path(tmp) / f"{name}.json").write_text(json.dumps(outs))
    distributed.finish()


def test_kl_in_reward_on_two_ranks_matches_one(tmp_path):
    """use_kl_in_reward on two FSDP2 ranks: each rank gathers the whole mini-batch's log-probs,
    so the KL penalty, its adapted coefficient, the advantages and the losses are one process's."""
    mp.spawn(_steps_rank, args=(2, free_port(), str(tmp_path), "kl", list(range(1, STEPS + 1))), nprocs=2, join=True)
    two = json.loads((tmp_path / "kl.json").read_text())
    one = Trainer(cfg(tmp_path, use_remove_padding=False, **KL_IN_REWARD))
    expected = [one.step(parity_batch(seed)) for seed in range(1, STEPS + 1)]
    assert expected[-1]["reward_kl_penalty"] > 0  # the policy moved off the reference: a KL to match
    assert expected[-1]["reward_kl_penalty_coeff"] != 0.05  # ... and the adaptive coefficient moved
    off = [(step, key, got[key], want[key]) for step, (got, want) in enumerate(zip(two, expected))
           for key, floor in (("reward_kl_penalty", 1e-3), ("reward_kl_penalty_coeff", 1e-3), ("rewards_mean", 1e-3),
                              ("advantages_max", 1e-3), ("advantages_mean", 0.1), ("loss", 1e-2), ("grad_norm", 1e-3))
           # floors: the whitened advantages' mean is ~0, and the loss (~2e-3 here) a mean of terms of
           # order one (advantage x ratio) that nearly cancel: float32's summation order (two ranks'
           # against one's, on CI's CPU: 3e-8 apart) is already 1e-5 of it; 1e-7 is float32's epsilon
           if abs(got[key] - want[key]) > 1e-5 * max(abs(want[key]), floor)]
    assert not off, off


#: GVPO (verl-recipe's group loss): its group means gathered from both ranks before each epoch (the
#: second epoch's from a forward pass at the stepped weights), a sharded KL reference, a chunked sequence
GVPO = dict(policy_loss=PolicyLossConfig(loss_mode="gvpo", gvpo_beta=0.5), norm_adv_by_std_in_grpo=False, kl_coef=0.1,
            max_tokens_per_micro_batch=64, micro_batch_size=2, ppo_epochs=2)


#: the settings ``_steps_rank`` trains with, by name
RANK_SETTINGS = {"kl": KL_IN_REWARD, "gvpo": GVPO}


def test_gvpo_on_two_ranks_matches_one(tmp_path):
    """GVPO measures each sequence against its group's mean log-ratio: on two FSDP2 ranks a
    group's members sit on both (and in several micro-batches), and each rank gathers the whole
    mini-batch's, so the losses, the gradient norms and GVPO's residual are one process's."""
    mp.spawn(_steps_rank, args=(2, free_port(), str(tmp_path), "gvpo", [1, 2]), nprocs=2, join=True)  # (2: chunked)
    two = json.loads((tmp_path / "gvpo.json").read_text())
    one = Trainer(cfg(tmp_path, use_remove_padding=False, **GVPO))
    expected = [one.step(parity_batch(seed)) for seed in (1, 2)]
    assert all(e["gvpo/residual"] > 0 and e["pg_loss"] > 0 for e in expected), expected
    off = [(step, key, got[key], want[key]) for step, (got, want) in enumerate(zip(two, expected))
           for key in ("loss", "pg_loss", "grad_norm", "gvpo/residual", "kl")
           if abs(got[key] - want[key]) > 1e-5 * max(abs(want[key]), 1e-3)]
    assert not off, off


def test_token_budget_never_exceeded_and_exact(tmp_path):
    samples = batch(7, n=6, long=4096)
    assert sum(len(s.prompt_ids) + len(s.response_ids) for s in samples[:1]) == 4096
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole = Trainer(cfg(tmp_path, micro_batch_size=64, loss_agg_mode=mode))
        split = Trainer(cfg(tmp_path, max_tokens_per_micro_batch=1024, loss_agg_mode=mode))
        a, b = whole.step(samples), split.step(samples)
        assert max(split.forward_tokens) <= 1024 < max(whole.forward_tokens)
        assert len(split.forward_tokens) >= 5  # the long one in four chunks, and the short ones
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (mode, a["loss"], b["loss"])
        for (name, pa), pb in zip(whole.model.named_parameters(), split.model.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-6, msg=f"{mode} {name}")


def assert_same_update(padded: Trainer, packed: Trainer, samples) -> None:
    """Log-probs, loss and gradients of one step of ``packed`` are ``padded``'s to 1e-5 relative."""
    for a, b in zip(padded.logprobs(samples), packed.logprobs(samples)):
        torch.testing.assert_close(torch.from_numpy(b), torch.from_numpy(a), rtol=1e-5, atol=1e-5)
    a, b = padded.step(samples), packed.step(samples)
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    for (name, pa), pb in zip(padded.model.named_parameters(), packed.model.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-5 * float(pa.grad.abs().max()), msg=name)


@pytest.mark.parametrize("budget", [0, 96])
def test_packed_micro_batches_match_padded(tmp_path, budget):
    """Padding-free micro-batches (issue 40) on mixed lengths (2 to 190 tokens, one longer than
    the budget, run in chunks): log-probs, loss and gradients are the padded path's to 1e-5
    relative in fp32, with the proximal (decoupled) and KL-reference passes packed too, and
    every pass holds real tokens only, within the budget."""
    samples = batch(5, n=10, long=190)
    kw = dict(decoupled=True, kl_coef=0.1, max_tokens_per_micro_batch=budget)
    padded = Trainer(cfg(tmp_path, use_remove_padding=False, **kw))
    packed = Trainer(cfg(tmp_path, use_remove_padding=True, **kw))
    assert packed.packed and not padded.packed
    assert_same_update(padded, packed, samples)
    lengths = sorted(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    passes = len(packed.forward_tokens) // 3  # proximal, reference, then the update
    if budget:
        assert max(packed.forward_tokens) <= budget
        assert sum(packed.forward_tokens[:passes]) == sum(lengths) + 2  # real tokens, + the 2-token unit closing chunks
    else:
        assert sum(packed.forward_tokens[:passes]) == sum(lengths)
    assert sum(packed.forward_tokens) < sum(padded.forward_tokens)


def test_uniform_lengths_pack_as_a_view_and_match_padded(tmp_path):
    """The default task's shape (issue 52): every sequence the same length, so the packed row is
    a [count, length] batch as it is (no gather); log-probs, loss and gradients are padding's."""
    import numpy as np

    from streamrl.learner import packing
    from streamrl.learner.samples import Sample

    rng = np.random.default_rng(9)
    samples = [Sample(id=f"u{i}", group_id=f"g{i // 4}", reward=float(rng.random()), policy_version=0,
                      prompt_ids=rng.integers(0, 256, 7), response_ids=rng.integers(0, 256, 3),
                      behaviour_logprobs=rng.normal(-5.5, 0.3, 3).astype(np.float32)) for i in range(12)]
    padded = Trainer(cfg(tmp_path, use_remove_padding=False, micro_batch_size=64))
    packed = Trainer(cfg(tmp_path, use_remove_padding=True, micro_batch_size=64))
    assert packed.packed and not padded.packed
    _, cu, _ = packing.layout([10] * 12, "cpu")
    assert packing._plan(cu).uniform == 10
    assert_same_update(padded, packed, samples)


def test_length_buckets_bound_the_padded_attention():
    """Packed attention without flash-attn runs one SDPA call per bucket: every sequence in
    exactly one; short sequences (the default task's) in one bucket whatever their lengths; a
    bucket of longer ones keeps its padded square within BUCKET_WASTE of its own squares."""
    import numpy as np

    from streamrl.learner.packing import BUCKET_WASTE, SHORT_TOKENS, buckets

    assert buckets([10] * 64) == [list(range(64))]
    assert buckets([8, 10, 9, 1, 10, 32]) == [[5, 1, 4, 2, 0, 3]]
    rng = np.random.default_rng(0)
    lengths = [int(np.exp(rng.uniform(np.log(32), np.log(2049)))) for _ in range(64)]
    groups = buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(64))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert longest == lengths[g[0]]
        if longest > SHORT_TOKENS:
            assert len(g) * longest ** 2 <= BUCKET_WASTE * sum(lengths[i] ** 2 for i in g)
    assert 2 < len(groups) < 64, len(groups)


def test_use_remove_padding_auto_true_false(tmp_path, monkeypatch, caplog):
    """auto (the default) packs where the model can and pads where it cannot, saying which and
    why; true is obeyed or refused at start naming the field; verl's ``True`` is true."""
    from transformers import Qwen2ForCausalLM

    assert LearnerConfig().use_remove_padding == "auto"
    assert LearnerConfig(use_remove_padding="True").validate().use_remove_padding == "true"
    assert LearnerConfig(use_remove_padding=False).validate().use_remove_padding == "false"
    with pytest.raises(ConfigError, match="learner.use_remove_padding"):
        LearnerConfig(use_remove_padding="sometimes").validate()
    caplog.set_level("INFO", logger="streamrl.learner.trainer")
    auto = Trainer(cfg(tmp_path, micro_batch_size=64))
    assert auto.packed
    assert ("packed micro-batches (learner.use_remove_padding=auto): mini-batches whose padded micro-batches "
            "would hold >= 20% padding, the others padded; attention by SDPA") in caplog.text
    # auto decides per mini-batch: a little padding (1 token of 120) trains padded, much packed
    little = batch(3, n=12)
    for i, s in enumerate(little):
        s.prompt_ids, s.response_ids = s.prompt_ids[:1].repeat(7), s.response_ids[:1].repeat(3 - (i == 0))
        s.behaviour_logprobs = s.behaviour_logprobs[:1].repeat(len(s.response_ids))
    auto.step(little)
    assert auto.forward_tokens == [120]
    mixed = batch(4, n=12)
    auto.step(mixed)
    assert auto.forward_tokens == [sum(len(s.prompt_ids) + len(s.response_ids) for s in mixed)]
    caplog.clear()
    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_attention_backend", False)
    caplog.clear()
    assert not Trainer(cfg(tmp_path)).packed
    assert "padded micro-batches (learner.use_remove_padding=auto): Qwen2ForCausalLM cannot pack" in caplog.text
    with pytest.raises(ConfigError, match="'learner.use_remove_padding': true, but Qwen2ForCausalLM cannot pack"):
        Trainer(cfg(tmp_path, use_remove_padding=True))


def test_a_model_that_cannot_pack_trains_padded(tmp_path, monkeypatch):
    """Packing is checked, not assumed: a model outside transformers' attention interface, or one
    whose packed forward differs from its padded one, trains padded with its own attention."""
    from transformers import Qwen2ForCausalLM

    from streamrl.learner import packing

    with monkeypatch.context() as m:
        m.setattr(Qwen2ForCausalLM, "_supports_attention_backend", False)
        trainer = Trainer(cfg(tmp_path))
    assert not trainer.packed and trainer.model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(packing, "_compare", lambda model: (False, "differs"))
    trainer = Trainer(cfg(tmp_path, kl_coef=0.1))
    assert not trainer.packed
    assert {trainer.model.config._attn_implementation, trainer.reference.config._attn_implementation} == {"sdpa"}
    assert trainer.step(batch(4))["tokens"] > 0


def test_micro_batch_plans_balance_tokens():
    lengths = [4096, 30, 900, 500, 500, 100, 100, 20]
    parts = microbatch.balance(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = sorted(sum(lengths[i] for i in p) for p in parts)
    assert parts[0] == [0] or parts[1] == [0]  # the long one alone; the rest on the other rank
    assert loads == [sum(lengths) - 4096, 4096]
    mbs = microbatch.split(lengths, 1000)
    assert all(microbatch.forward_tokens(lengths, mb, 1000) <= 1000 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(len(lengths)))
    assert [mb.chunks for mb in mbs if 0 in mb.indices] == [5]
    packed = microbatch.split(lengths, 1000, packed=True)  # real tokens, balanced, longest first
    assert sorted(i for mb in packed for i in mb.indices) == list(range(len(lengths)))
    sizes = [microbatch.forward_tokens(lengths, mb, 1000, packed=True) for mb in packed if mb.chunks == 1]
    assert max(sizes) <= 1000 and len(sizes) == 3 and sum(sizes) == sum(lengths) - 4096, sizes
    padded = [microbatch.forward_tokens(lengths, mb, 1000) for mb in mbs if mb.chunks == 1]
    assert sum(sizes) < sum(padded)  # padding is gone


def test_memory_limit_refuses_at_start(tmp_path):
    with pytest.raises(ConfigError, match="learner.max_memory_gb"):
        Trainer(cfg(tmp_path, max_memory_gb=0.0001))
    with pytest.raises(ConfigError, match="learner.parallel.nproc"):
        LearnerConfig(parallel=ParallelConfig(nproc=0)).validate()


def _rank_pid(run_pid: int, rank: int) -> int | None:
    """The learner rank ``rank`` under the run (its environment says LOCAL_RANK)."""
    from tests.helpers import alive, descendants

    for pid in descendants(run_pid):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in env and b"learner" in argv and alive(pid):
            return pid
    return None


@pytest.mark.e2e
def test_run_with_two_learner_ranks_survives_a_killed_rank(tmp_path):
    """``streamrl run learner.parallel.nproc=2`` on the embedded default; rank 1 SIGKILLed
    after a version: the group goes down, the supervisor restarts it from the checkpoint, the
    run completes, versions never go back, and the surviving line trained each mini-batch once."""
    import time

    from tests.helpers import gsm8k_run_config, run_summary, start_run

    versions, per_version = 5, 2 * 4  # local.yaml: groups_per_mini_batch x group_size
    proc = start_run(*gsm8k_run_config(), f"run.out_dir={tmp_path}", "run.reward_members=1", "feed.limit=200",
                     f"learner.versions={versions}", "learner.parallel.nproc=2", "learner.groups_per_mini_batch=2",
                     "feed.group_size=4", "run.restart.backoff_s=0.5",
                     env={"STREAMRL_LOG_LEVEL": "INFO"})  # the learner logs each version it announces
    out_dir = None

    def kill_rank_1() -> None:
        nonlocal out_dir
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # after the first checkpoint
            found = list(tmp_path.glob("*/checkpoints/ckpt-*"))
            if found:
                out_dir = found[0].parent.parent
                break
            time.sleep(0.5)
        assert out_dir is not None, "no checkpoint before the kill"
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None, "no learner rank 1"
        os.kill(pid, 9)

    summary, _, _ = run_summary(proc, 400, kill_rank_1)
    assert summary["ended"] in ("done", "data_exhausted"), summary
    assert summary["versions"] == versions and summary["restarts"] >= 1, summary
    log = (out_dir / "logs" / "learner.log").read_text()
    assert log.count("2 ranks through torch.distributed.run") >= 2 and "resumed from" in log
    state = json.loads((sorted((out_dir / "checkpoints").glob("ckpt-*"))[-1] / "state.json").read_text())
    assert state["version"] == versions and state["trained_records"] == versions * per_version, state
    announced = [int(line.split("version ")[1].split()[0]) for line in log.splitlines()
                 if "learner: version " in line and " at " in line]
    assert announced == sorted(announced), announced


def test_gradient_checkpointing_changes_memory_not_math(tmp_path):
    samples = batch(3)
    plain, ckpt = Trainer(cfg(tmp_path)), Trainer(cfg(tmp_path, gradient_checkpointing=True))
    on = [m for m in ckpt.model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert on and not [m for m in plain.model.modules() if getattr(m, "gradient_checkpointing", False)]
    a, b = plain.step(samples), ckpt.step(samples)
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
    for pa, pb in zip(plain.model.parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-7)
