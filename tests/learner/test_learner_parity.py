"""streamrl's advantage estimators, policy losses, loss aggregation and KL estimators against
the numbers verl's own functions give on the same tensors (issue 37): ``verl_parity_data.py``,
written by ``tests/learner/verl_parity.py`` from verl 0.9.1 (the file names the release and the sha256
of the ``core_algos.py`` it called). Two shapes (groups of 2/3/3 over 6 tokens with padding and
a masked token inside a response, groups of 4/4 over 4 tokens), each in fp64 and fp32: within
1e-6 relative in fp64, 1e-5 in fp32, for the values and for the gradients."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.learner import losses
from tests.learner import verl_parity_data

DATA = json.loads(verl_parity_data.DATA)
CASES = [(case, dtype) for case in DATA["cases"] for dtype in ("float64", "float32")]
TOL = {"float64": dict(rtol=1e-6, atol=1e-9), "float32": dict(rtol=1e-5, atol=1e-6)}


def tensors(case: str, dtype: str) -> dict:
    raw = DATA["cases"][case]["inputs"]
    out = {k: torch.tensor(v, dtype=getattr(torch, dtype)) for k, v in raw.items() if k != "index"}
    out["index"] = raw["index"]
    return out


def expected(case: str, dtype: str) -> dict:
    return DATA["cases"][case]["results"][dtype]


def close(ours: torch.Tensor, theirs, dtype: str, what: str) -> None:
    torch.testing.assert_close(ours.detach(), torch.tensor(theirs, dtype=ours.dtype), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def test_the_numbers_came_from_verl_and_the_config_names_every_function():
    from streamrl.learner import config

    assert DATA["verl"] == "0.9.1" and len(DATA["core_algos_sha256"]) == 64
    assert set(config.ADV_ESTIMATORS) == set(losses.ADV_ESTIMATORS)
    assert set(config.LOSS_MODES) == set(losses.POLICY_LOSSES)


@pytest.mark.parametrize("case, dtype", CASES)
def test_advantage_estimators_equal_verls(case, dtype):
    t, want = tensors(case, dtype), expected(case, dtype)["advantages"]
    rewards = losses.token_rewards(t["scores"], t["mask"])
    assert set(want) - {"grpo_dr"} <= set(losses.ADV_ESTIMATORS)
    for name, theirs in want.items():
        opt = losses.AdvantageOptions(norm_adv_by_std_in_grpo=name != "grpo_dr", gamma=1.0)
        fn = losses.ADV_ESTIMATORS["grpo" if name == "grpo_dr" else name]
        close(fn(rewards, t["mask"], t["index"], opt), theirs, dtype, f"{case}/{dtype} {name}")


@pytest.mark.parametrize("case, dtype", CASES)
def test_policy_losses_and_their_gradients_equal_verls(case, dtype):
    t, want = tensors(case, dtype), expected(case, dtype)["losses"]
    assert set(want) | {"gvpo"} == set(losses.POLICY_LOSSES)  # (gvpo, a recipe's: test_recipe_parity.py)
    opt = losses.LossOptions(**DATA["knobs"])
    for mode, theirs in want.items():
        logp = t["logp"].clone().requires_grad_(True)
        torch.manual_seed(DATA["seed"])  # clip_cov picks its tokens at random, as verl's does
        pl = losses.policy_loss(mode, t["old_logp"], logp, t["advantages"], t["mask"], opt)
        loss = losses.aggregate(pl.loss, t["mask"], pl.agg_mode or "token-mean")
        loss.backward()
        close(loss, theirs["loss"], dtype, f"{case}/{dtype} {mode} loss")
        close(logp.grad, theirs["grad"], dtype, f"{case}/{dtype} {mode} gradient")
        if mode in ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "clip_cov"):
            clipfrac = losses.aggregate(pl.clipped, t["mask"], "token-mean")
            close(clipfrac, theirs["clipfrac"], dtype, f"{case}/{dtype} {mode} clip fraction")


@pytest.mark.parametrize("case, dtype", CASES)
def test_loss_aggregation_equals_verls(case, dtype):
    t, want = tensors(case, dtype), expected(case, dtype)["agg"]
    values = t["logp"] * t["advantages"]
    for mode, theirs in want.items():
        close(losses.aggregate(values, t["mask"], mode, scale=7), theirs, dtype, f"{case}/{dtype} {mode}")


@pytest.mark.parametrize("case, dtype", CASES)
def test_kl_estimators_and_their_gradients_equal_verls(case, dtype):
    t, want = tensors(case, dtype), expected(case, dtype)["kl"]
    for kind, theirs in want.items():
        logp = t["logp"].clone().requires_grad_(True)
        kl = losses.kl_penalty(logp, t["ref_logp"], kind)
        (kl * t["mask"]).sum().backward()
        close(kl, theirs["value"], dtype, f"{case}/{dtype} {kind}")
        close(logp.grad, theirs["grad"], dtype, f"{case}/{dtype} {kind} gradient")


def test_aggregation_over_micro_batches_equals_the_whole_mini_batch():
    """Every mode: the micro-batches' aggregates, each normalised by the mini-batch's totals,
    add up to the mini-batch's own (what gradient accumulation and FSDP ranks rely on)."""
    t = tensors("mixed", "float64")
    values, mask = t["logp"] * t["advantages"], t["mask"]
    totals = dict(total_tokens=float(mask.sum()), total_seqs=float((mask.sum(-1) > 0).sum()), scale=7)
    for mode in losses.LOSS_AGG_MODES:
        whole = losses.aggregate(values, mask, mode, scale=7)
        parts = sum(losses.aggregate(values[i:i + 3, :w], mask[i:i + 3, :w], mode, **totals)
                    for i, w in ((0, 6), (3, 6), (6, 6)))
        torch.testing.assert_close(parts, whole, msg=mode)
