"""streamrl's distillation losses (``streamrl.learner.losses``: ``forward_kl_topk``, the KL
estimators, ``distillation_loss``) against the numbers verl 0.9.1's own functions give on the
same tensors: ``verl_distill_parity_data.py``, written by ``tests/distillation/verl_distill_parity.py``, which
called ``verl.trainer.distillation.losses.distillation_loss`` (fed by verl's FSDP
``compute_forward_kl_topk`` for the top-k loss) on every loss mode, with and without the policy
gradient, over three aggregation modes and three clamp settings. Values and gradients with
respect to the student's logits, in fp64, within 1e-6 (verl computes the top-k KL in fp32:
``atol`` 1e-7 covers that)."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.distillation import config as dconfig
from streamrl.learner import losses
from tests.distillation import verl_distill_parity_data
from tests.helpers import distill_samples

DATA = json.loads(verl_distill_parity_data.DATA)
TOL = dict(rtol=1e-6, atol=1e-7)


def _inputs() -> dict[str, torch.Tensor]:
    t = {k: torch.tensor(v) for k, v in DATA["inputs"].items()}
    return {k: v.double() if v.is_floating_point() else v for k, v in t.items()}


def ours(case: dict, t: dict, rows: slice = slice(None), totals: dict | None = None):
    """streamrl's loss of ``case`` on the rows ``rows`` of the batch, and the student's logits."""
    logits = t["student_logits"][rows].clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, t["sampled"][rows].unsqueeze(-1)).squeeze(-1)
    if case["mode"] == "forward_kl_topk":
        terms = losses.forward_kl_topk(logp_all.gather(-1, t["teacher_topk_ids"][rows]),
                                       t["teacher_topk_logprobs"][rows], case["log_prob_min_clamp"])
    else:
        terms = losses.estimator_distillation(logp, t["teacher_logprobs"][rows], case["mode"])
    mask = t["mask"]
    agg = totals or dict(total_tokens=mask.sum(), total_seqs=float((mask.sum(-1) > 0).sum()))
    loss = losses.distillation_loss(terms, mask[rows], case["agg"], logp=logp, old_logp=t["old_logprobs"][rows],
                                    loss_max_clamp=case["loss_max_clamp"],
                                    use_policy_gradient=case["use_policy_gradient"], **agg)
    return loss, logits


def test_the_numbers_came_from_verl_and_every_mode_is_covered():
    assert DATA["verl"] == "0.9.1" and len(DATA["losses_sha256"]) == 64
    assert set(dconfig.LOSS_MODES) == set(losses.DISTILLATION_LOSSES)
    assert {c["mode"] for c in DATA["results"].values()} == set(losses.DISTILLATION_LOSSES)


@pytest.mark.parametrize("name", sorted(DATA["results"]))
def test_distillation_loss_and_its_gradient_equal_verls(name):
    case = DATA["results"][name]
    loss, logits = ours(case, _inputs())
    loss.backward()
    torch.testing.assert_close(loss.detach(), torch.tensor(case["loss"], dtype=torch.float64), **TOL)
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64), **TOL)


@pytest.mark.parametrize("name", [n for n in sorted(DATA["results"]) if "|seq-mean-token-sum" not in n][::3])
def test_micro_batches_add_up_to_the_whole(name):
    """Two micro-batches with the mini-batch's totals: the same loss and gradients as one."""
    case, t = DATA["results"][name], _inputs()
    mask = t["mask"]
    totals = dict(total_tokens=mask.sum(), total_seqs=float((mask.sum(-1) > 0).sum()))
    whole, logits = ours(case, t, slice(None), totals)
    whole.backward()
    a, la = ours(case, t, slice(0, 2), totals)
    b, lb = ours(case, t, slice(2, 3), totals)
    (a + b).backward()
    torch.testing.assert_close(a + b, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([la.grad, lb.grad]), logits.grad, rtol=1e-12, atol=1e-12)


def test_task_rewards_combine_as_verl_does():
    task, distill = torch.tensor(2.0), torch.tensor(3.0)
    assert float(losses.combine_distillation(task, distill, use_task_rewards=True, coef=0.5)) == 3.5
    assert float(losses.combine_distillation(task, distill, use_task_rewards=False, coef=0.5)) == 3.0


def test_the_config_refuses_what_verl_refuses():
    from streamrl.errors import ConfigError

    cfg = dconfig.DistillationConfig(enabled=True)
    cfg.distillation_loss.loss_mode = "k1"
    with pytest.raises(ConfigError, match="use_policy_gradient"):
        cfg.validate()
    cfg.distillation_loss.use_policy_gradient = True
    cfg.validate()
    cfg.distillation_loss.loss_mode = "nope"
    with pytest.raises(ConfigError, match="loss_mode"):
        cfg.validate()


# -- the learner's trainer: the loss in a real update, exact over micro-batches -------------------

@pytest.mark.parametrize("mode, use_pg, task", [("forward_kl_topk", False, False), ("k3", False, True),
                                                ("k1", True, True)])
def test_the_trainer_distils_the_same_over_any_micro_batches(mode, use_pg, task):
    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.trainer import Trainer

    results = []
    for mbs in (4, 1):
        cfg = LearnerConfig(policy="tiny", micro_batch_size=mbs, lr=1e-2, grad_clip=0.0, use_remove_padding="false")
        dl = cfg.distillation.distillation_loss
        cfg.distillation.enabled, dl.loss_mode, dl.topk = True, mode, 3
        dl.use_policy_gradient, dl.use_task_rewards, dl.loss_max_clamp = use_pg, task, 5.0
        cfg.distillation.validate()
        trainer = Trainer(cfg)
        vocab = trainer.model.get_input_embeddings().num_embeddings
        metrics = trainer.step(distill_samples(vocab, 3 if mode == "forward_kl_topk" else 0))
        results.append((metrics, [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]))
    (m4, p4), (m1, p1) = results
    assert m4["distillation/loss"] == pytest.approx(m1["distillation/loss"], rel=1e-5, abs=1e-6)
    assert abs(m4["distillation/loss"]) > 0
    # verl's MIN / MAX metrics: the per-token loss's range, the same over any micro-batches
    assert m4["distillation/loss_min"] == pytest.approx(m1["distillation/loss_min"], rel=1e-5, abs=1e-6)
    assert m4["distillation/loss_max"] == pytest.approx(m1["distillation/loss_max"], rel=1e-5, abs=1e-6)
    assert m4["distillation/loss_min"] < m4["distillation/loss_max"]
    if mode == "forward_kl_topk":
        assert 0 < m4["distillation/teacher_mass"] <= 0.9 + 1e-5 and 0 < m4["distillation/student_mass"] < 1
    assert len(p4) == len(p1) > 0
    for a, b in zip(p4, p1):  # the gradients of the step (Adam would amplify fp32 noise in ~0 ones)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
