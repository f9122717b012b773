"""verl-recipe's algorithms (issue 66): streamrl's ``gvpo`` loss against the recipe's own
``compute_policy_loss_gvpo``, values and gradients, on the cases ``recipe_parity.py`` recorded
(one rank, and two ranks whose groups are split between them: the recipe gathers its
micro-batch's log-ratios over the data-parallel ranks, streamrl gathers the whole mini-batch's);
and the loss as the trainer aggregates it."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.learner import losses
from tests.learner.recipe_parity import ONE_RANK, TWO_RANKS, case_inputs, digest
from tests.learner.recipe_parity_data import DATA

RECORD = json.loads(DATA)


def _ours(case: dict, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's loss (the sum over its rows, as the recipe's function returns) and gradient:
    the group baseline from every rank's rows, as ``Objective.set_group_baselines`` makes it."""
    ratio = losses.sequence_log_ratio(case["old"], case["logp"], case["mask"])
    baseline = losses.group_baseline(case["beta"] * ratio, [str(float(u)) for u in case["uid"]])
    out = []
    B = len(case["uid"])
    for rank in range(world):
        rows = slice(rank * B // world, (rank + 1) * B // world)
        logp = case["logp"][rows].clone().requires_grad_(True)
        mine = losses.GroupBaseline(mean=baseline.mean[rows], size=baseline.size[rows])
        loss = losses.gvpo_sequence_losses(case["old"][rows], logp, case["advantages"][rows], case["mask"][rows],
                                           case["beta"], mine).sum()
        loss.backward()
        out.append((loss.detach(), logp.grad))
    return out


def test_gvpo_equals_the_recipes_loss_and_gradient_on_every_recorded_case():
    """All 220 cases (160 on one rank, 60 on two), float64: group sizes 2-8, 1-4 groups, 1-12
    tokens with holes, log-ratio spreads up to 12 nats a token, beta 0.01-1, rewards over four
    decades, 0/1 rewards, GRPO's centred and arbitrary per-token advantages."""
    assert RECORD["recipe"].endswith("compute_policy_loss_gvpo") and len(RECORD["source_sha256"]) == 64
    cases = RECORD["cases"]
    assert len(cases) == ONE_RANK + TWO_RANKS == 220
    worst_value = worst_grad = 0.0
    for rec in cases:
        case = case_inputs(rec["seed"], rec["world"])
        assert digest(case) == rec["digest"], f"case {rec['seed']}/{rec['world']}: the generator changed"
        for rank, ((loss, grad), theirs) in enumerate(zip(_ours(case, rec["world"]), rec["ranks"], strict=True)):
            want_loss = torch.tensor(theirs["loss"], dtype=torch.float64)
            want_grad = torch.tensor(theirs["grad"], dtype=torch.float64)
            where = f"case {rec['seed']} on {rec['world']} rank(s), rank {rank}"
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12, msg=where)
            torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12, msg=where)
            worst_value = max(worst_value, float((loss - want_loss).abs()))
            worst_grad = max(worst_grad, float((grad - want_grad).abs().max()))
    print(f"gvpo parity: {len(cases)} cases, max abs diff value {worst_value:.3g}, gradient {worst_grad:.3g}")


def test_the_trainers_gvpo_is_the_recipes_step():
    """The registered loss as the trainer aggregates it (seq-mean-token-sum over the mini-batch's
    sequences, times ``gvpo_scale``): ``micro_batch_size / B`` times the recipe's sum, whatever
    ``loss_agg_mode`` says; the importance weight of rollout correction refused."""
    case = case_inputs(3, 1)
    B = len(case["uid"])
    ratio = losses.sequence_log_ratio(case["old"], case["logp"], case["mask"])
    baseline = losses.group_baseline(case["beta"] * ratio, [str(float(u)) for u in case["uid"]])
    opt = losses.LossOptions(gvpo_beta=case["beta"], gvpo_scale=4.0)
    pl = losses.policy_loss("gvpo", case["old"], case["logp"], case["advantages"], case["mask"], opt,
                            baseline=baseline)
    assert pl.agg_mode == "seq-mean-token-sum"
    step = losses.aggregate(pl.loss, case["mask"], pl.agg_mode, total_seqs=torch.tensor(B))
    recipe_sum = losses.gvpo_sequence_losses(case["old"], case["logp"], case["advantages"], case["mask"],
                                             case["beta"], baseline).sum()
    torch.testing.assert_close(step, 4.0 / B * recipe_sum, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="importance weight"):
        losses.policy_loss("gvpo", case["old"], case["logp"], case["advantages"], case["mask"], opt,
                           is_weight=torch.ones_like(case["mask"]), baseline=baseline)
    with pytest.raises(ValueError, match="group baseline"):
        losses.policy_loss("gvpo", case["old"], case["logp"], case["advantages"], case["mask"], opt)


def test_a_group_of_one_and_a_padding_row_train_nothing():
    """A group with one member in the mini-batch has nothing to be measured against (the recipe
    divides by zero): 0, no gradient; nor the ranks' padding row (a group of size 0)."""
    mask = torch.ones(3, 4, dtype=torch.float64)
    mask[2] = 0.0
    logp = torch.full((3, 4), -1.0, dtype=torch.float64, requires_grad=True)
    old, adv = torch.full((3, 4), -1.5, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    baseline = losses.GroupBaseline(mean=torch.tensor([0.2, 0.0, 0.0], dtype=torch.float64),
                                    size=torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    out = losses.gvpo_sequence_losses(old, logp, adv, mask, 0.1, baseline)
    out.sum().backward()
    assert out.tolist() == [0.0, 0.0, 0.0] and torch.isfinite(logp.grad).all() and not logp.grad.any()
