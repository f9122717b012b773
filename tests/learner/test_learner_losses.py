"""The objective's pieces against hand computations (pure torch, no broker)."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner import losses


def test_grpo_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 4.0])
    groups = ["a", "a", "a", "b", "b", "b"]
    adv = losses.grpo_advantages(rewards, groups)
    # group a: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    sa = math.sqrt(1 / 3)
    # group b: mean 6.5/3, unbiased std
    mb = 6.5 / 3
    sb = math.sqrt(((0.5 - mb) ** 2 + (2 - mb) ** 2 + (4 - mb) ** 2) / 2)
    want = [(1 - 1 / 3) / sa, (-1 / 3) / sa, (-1 / 3) / sa,
            (0.5 - mb) / sb, (2 - mb) / sb, (4 - mb) / sb]
    assert adv.tolist() == pytest.approx(want, rel=1e-5)
    # without std normalisation: reward minus group mean
    plain = losses.grpo_advantages(rewards, groups, norm_by_std=False)
    assert plain.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.5 - mb, 2 - mb, 4 - mb], rel=1e-5)
    # all-equal rewards carry no signal
    assert losses.grpo_advantages(torch.ones(4), ["g"] * 4).abs().max() == 0


def test_ppo_clip_limits_the_ratio_in_the_advantage_direction():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.1, 1.5, 0.5]]))  # ratios 1, 1.1, 1.5, 0.5
    pos = losses.ppo_clip_loss(old, logp, torch.tensor([1.0]), clip_c=0)
    # A > 0: loss = -min(r, 1.2) when r > 1; below 1-eps the unclipped (lower) ratio wins
    assert pos.loss[0].tolist() == pytest.approx([-1.0, -1.1, -1.2, -0.5], rel=1e-6)
    assert pos.clipped[0].tolist() == [0, 0, 1, 0]
    neg = losses.ppo_clip_loss(old, logp, torch.tensor([-1.0]), clip_c=0)
    # A < 0: loss = max(r, clip(r)) -> the 0.5 ratio is held at 0.8
    assert neg.loss[0].tolist() == pytest.approx([1.0, 1.1, 1.5, 0.8], rel=1e-6)
    assert neg.clipped[0].tolist() == [0, 0, 0, 1]
    # a clipped token has no gradient
    lp = logp.clone().requires_grad_(True)
    losses.ppo_clip_loss(old, lp, torch.tensor([1.0]), clip_c=0).loss.sum().backward()
    assert lp.grad[0, 2] == 0 and lp.grad[0, 1] != 0


def test_dual_clip_truncates_large_ratios_with_negative_advantages():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[2.0, 10.0]])).requires_grad_(True)
    out = losses.ppo_clip_loss(old, logp, torch.tensor([-1.0]), clip_c=3.0)
    assert out.loss[0].tolist() == pytest.approx([2.0, 3.0])  # the ratio 10 is truncated at c=3
    assert out.clipped[0].tolist() == [0, 1]
    out.loss.sum().backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0
    no_dual = losses.ppo_clip_loss(old, logp, torch.tensor([-1.0]), clip_c=0)
    assert no_dual.loss[0, 1].item() == pytest.approx(10.0)


def test_importance_weight_truncation_and_masking():
    behav = torch.log(torch.tensor([[0.1, 0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.25]]))  # w = 5, 1, 0.5
    mask = torch.ones(1, 3)
    w, m = losses.importance_weight(prox, behav, mask, cap=2.0, mode="truncate")
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 0.5]) and m.tolist() == mask.tolist()
    w, m = losses.importance_weight(prox, behav, mask, cap=2.0, mode="mask")
    assert m[0].tolist() == [0.0, 1.0, 1.0] and w[0, 1:].tolist() == pytest.approx([1.0, 0.5])


def test_aggregation_modes_differ_as_verl():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # token-mean: (4*1 + 3) / 5 tokens; seq-mean-token-mean: (1 + 3) / 2 sequences
    assert losses.aggregate(values, mask, "token-mean").item() == pytest.approx(7 / 5)
    assert losses.aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    # a micro-batch with the mini-batch's totals gives its share of the whole
    part = losses.aggregate(values[1:], mask[1:], "token-mean", total_tokens=5.0)
    assert part.item() == pytest.approx(3 / 5)
    with pytest.raises(ValueError):
        losses.aggregate(values, mask, "seq-sum")


def test_decoupled_objective_is_ppo_when_proximal_is_behaviour():
    torch.manual_seed(0)
    behav = torch.randn(3, 5) - 2
    adv = torch.randn(3)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    logp1 = (behav + 0.3 * torch.randn(3, 5)).requires_grad_(True)
    logp2 = logp1.detach().clone().requires_grad_(True)
    ppo = losses.ppo_clip_loss(behav, logp1, adv)
    dec, dmask = losses.decoupled_ppo_loss(logp2, behav, behav, adv, mask, cap=2.0)
    a = losses.aggregate(ppo.loss, mask, "token-mean")
    b = losses.aggregate(dec.loss, dmask, "token-mean")
    a.backward()
    b.backward()
    assert torch.equal(dmask, mask)
    assert a.item() == pytest.approx(b.item(), abs=1e-7)
    assert torch.allclose(logp1.grad, logp2.grad, atol=1e-7)
    # and with an older behaviour policy, the weight pi_prox/pi_behav changes the loss
    dec_old, _ = losses.decoupled_ppo_loss(logp2, behav, behav - 0.5, adv, mask, cap=2.0)
    assert not torch.allclose(dec_old.loss, dec.loss)


def test_kl_estimators():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    k1 = losses.kl_penalty(logp, ref, "kl")
    k3 = losses.kl_penalty(logp, ref, "low_var_kl")
    assert k1[0].tolist() == pytest.approx([math.log(2), 0.0])
    assert k3[0, 0].item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert k3[0, 1].item() == 0 and (k3 >= 0).all()


def test_entropy_from_logits():
    uniform = torch.zeros(1, 1, 8)
    assert losses.entropy_from_logits(uniform).item() == pytest.approx(math.log(8))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert losses.entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_registries_refuse_a_taken_name_and_name_the_known_ones():
    """verl's registries: a second function under a taken name is refused (it would silently
    replace the first), an unknown name's error lists the registered ones, and a loss registered
    outside the module is what ``policy_loss`` runs, in verl's argument order."""
    with pytest.raises(ValueError, match="'grpo' is registered already"):
        losses.register_adv_est("grpo")(lambda rewards, mask, group_ids, opt: rewards)
    with pytest.raises(ValueError, match="'vanilla' is registered already"):
        losses.register_policy_loss("vanilla")(lambda old_logp, logp, adv, mask, opt: None)
    assert losses.get_adv_estimator_fn("grpo") is losses.grpo_estimator
    assert losses.register_adv_est("grpo")(losses.grpo_estimator) is losses.grpo_estimator  # the same: kept
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope': one of .*grpo, grpo_passk"):
        losses.get_adv_estimator_fn("nope")
    with pytest.raises(ValueError, match="unknown policy loss 'nope': one of .*geo_mean, gpg, gspo"):
        losses.get_policy_loss_fn("nope")
    seen = []

    @losses.register_policy_loss("test_only_loss", sequence_weight=True)
    def test_only_loss(old_log_prob, log_prob, advantages, response_mask, opt):
        seen.append((old_log_prob, log_prob))
        return losses.gpg_loss(old_log_prob, log_prob, advantages, response_mask, opt)

    try:
        old, new = torch.zeros(1, 2), torch.tensor([[-1.0, -2.0]])
        weight = torch.tensor([[1.0, 4.0]])
        out = losses.policy_loss("test_only_loss", old, new, torch.ones(1, 2), torch.ones(1, 2),
                                 losses.LossOptions(), weight)
        assert seen[0][0] is old and seen[0][1] is new
        assert out.is_weight[0].tolist() == pytest.approx([2.0, 2.0])  # its own case: per sequence, geometric mean
        token = losses.policy_loss("gpg", old, new, torch.ones(1, 2), torch.ones(1, 2), losses.LossOptions(), weight)
        assert token.is_weight[0].tolist() == [1.0, 4.0]
    finally:
        del losses.POLICY_LOSSES["test_only_loss"]


def test_loss_options_from_config_copy_every_knob():
    from streamrl.learner.config import LearnerConfig

    cfg = LearnerConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=5.0, tau_pos=2.0, tau_neg=3.0,
                        micro_batch_size=6)
    cfg.policy_loss.clip_cov_ratio, cfg.policy_loss.kl_cov_ratio, cfg.policy_loss.ppo_kl_coef = 0.5, 0.25, 0.7
    cfg.policy_loss.clip_cov_lb, cfg.policy_loss.clip_cov_ub, cfg.policy_loss.gvpo_beta = 2.0, 6.0, 0.05
    opt = losses.LossOptions.from_config(cfg)
    # GVPO: its beta, and the recipe's scale, the sequences its micro-batch sums (1 without one)
    assert (opt.gvpo_beta, opt.gvpo_scale) == (0.05, 6.0)
    assert losses.LossOptions.from_config(LearnerConfig(micro_batch_size=0)).gvpo_scale == 1.0
    assert (opt.clip_ratio_low, opt.clip_ratio_high, opt.clip_ratio_c, opt.tau_pos, opt.tau_neg) == (0.1, 0.3, 5.0, 2.0, 3.0)
    assert (opt.clip_cov_ratio, opt.clip_cov_lb, opt.clip_cov_ub, opt.kl_cov_ratio, opt.ppo_kl_coef) == (0.5, 2.0, 6.0, 0.25, 0.7)
    assert {f for f in losses.LossOptions.__dataclass_fields__} == {
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
        "kl_cov_ratio", "ppo_kl_coef", "tau_pos", "tau_neg", "gvpo_beta", "gvpo_scale"}
