"""The parts issue 48 added against the numbers verl 0.9.1's own functions give
(``verl_parity_extra_data.py``, written by ``tests/verl_parity_extra.py``; the file names the
release and the sha256 of the ``core_algos.py`` it called), fp64 within 1e-6 relative, values
and gradients, on the two shapes of ``tests/verl_parity.py``."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from streamrl.learner import config, losses
from tests import verl_parity_extra_data

DATA = json.loads(verl_parity_extra_data.DATA)
TOL = dict(rtol=1e-6, atol=1e-9)


def tensors(case: str) -> dict:
    raw = DATA["cases"][case]["inputs"]
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in raw.items() if k != "index"}
    out["index"] = raw["index"]
    return out


def close(ours, theirs, what: str) -> None:
    ours = torch.as_tensor(ours, dtype=torch.float64)
    torch.testing.assert_close(ours.detach(), torch.tensor(theirs, dtype=torch.float64), **TOL,
                               msg=lambda m: f"{what}: {m}")


def test_the_numbers_came_from_verl_0_9_1():
    assert DATA["verl"] == "0.9.1" and len(DATA["core_algos_sha256"]) == 64


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_gspo_and_the_fixed_aggregation_losses_equal_verls_in_every_loss_agg_mode(case):
    """GSPO follows ``loss_agg_mode`` (verl 0.9.1's does); SAPO and GMPO fix theirs whatever it
    says. The trainer aggregates ``pl.agg_mode or cfg.loss_agg_mode``, as here."""
    t = tensors(case)
    opt = losses.LossOptions(**DATA["knobs"])
    want = DATA["cases"][case]["agg_losses"]
    assert {k.split("/")[1] for k in want} == set(config.LOSS_AGG_MODES)
    for key, theirs in want.items():
        mode, agg = key.split("/")
        logp = t["logp"].clone().requires_grad_(True)
        pl = losses.policy_loss(mode, logp, t["old_logp"], t["advantages"], t["mask"], opt)
        assert pl.agg_mode == config.FIXED_AGG_MODES.get(mode)
        loss = losses.aggregate(pl.loss, t["mask"], pl.agg_mode or agg, scale=7)
        loss.backward()
        close(loss, theirs["loss"], f"{case} {key} loss")
        close(logp.grad, theirs["grad"], f"{case} {key} gradient")


def test_a_config_whose_loss_fixes_or_suggests_another_aggregation_is_told_once_at_start():
    cfg = config.LearnerConfig()
    assert cfg.start_notes() == []
    cfg.policy_loss.loss_mode = "sapo"
    assert "seq-mean-token-mean whatever loss_agg_mode says" in cfg.start_notes()[0]
    cfg.loss_agg_mode = "seq-mean-token-mean"
    assert cfg.start_notes() == []
    cfg.policy_loss.loss_mode, cfg.loss_agg_mode = "gspo", "token-mean"
    assert "seq-mean-token-mean" in cfg.start_notes()[0]
    cfg.loss_agg_mode = "seq-mean-token-mean"
    assert cfg.start_notes() == []
