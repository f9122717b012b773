"""The parts issue 48 added against the numbers verl 0.9.1's own functions give
(``verl_parity_extra_data.py``, written by ``tests/learner/verl_parity_extra.py``; the file names the
release and the sha256 of the ``core_algos.py`` it called), fp64 within 1e-6 relative, values
and gradients, on the two shapes of ``tests/learner/verl_parity.py``."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.learner import config, losses
from tests.learner import verl_parity_extra_data

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
        pl = losses.policy_loss(mode, t["old_logp"], logp, t["advantages"], t["mask"], opt)
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


# -- rollout correction ------------------------------------------------------------------------

def corr_case(case: str) -> tuple[dict, dict]:
    return tensors(case), DATA["cases"][case]["rollout_correction"]


def close_metrics(ours: dict, theirs: dict, what: str) -> None:
    assert set(ours) == set(theirs), f"{what}: {sorted(set(ours) ^ set(theirs))}"
    for k in theirs:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-6, abs=1e-9), f"{what} {k}: {ours[k]} vs {theirs[k]}"


def test_the_registries_hold_verls_options():
    from streamrl.learner import rollout_correction as rc

    assert set(rc.IS_LEVELS) == {"token", "sequence"}
    assert set(rc.RS_OPTIONS) == set(config.RS_OPTION_NAMES) and len(config.RS_OPTION_NAMES) == 11
    tested = {o for c in DATA["cases"].values() for r in c["rollout_correction"]["rs"] for o in r["rollout_rs"].split(",")}
    assert tested == set(config.RS_OPTION_NAMES)


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_rollout_is_weights_and_their_figures_equal_verls(case):
    """Token and sequence level, truncated (TIS) and IcePop thresholds, with and without batch
    normalisation."""
    from streamrl.learner import rollout_correction as rc

    t, want = corr_case(case)
    for c in want["is"]:
        what = f"{case} {c['rollout_is']} {c['rollout_is_threshold']} norm={c['rollout_is_batch_normalize']}"
        w, m = rc.is_weights(t["logp"] - t["old_logp"], t["mask"], c["rollout_is"], c["rollout_is_threshold"],
                             c["rollout_is_batch_normalize"])
        close(w, c["weights"], what)
        close_metrics(m, c["metrics"], what)


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_rollout_rs_masks_and_their_figures_equal_verls(case):
    from streamrl.learner import rollout_correction as rc

    t, want = corr_case(case)
    for c in want["rs"]:
        what = f"{case} {c['rollout_rs']} {c['rollout_rs_threshold']}"
        kept, m = rc.rejection_mask(t["logp"] - t["old_logp"], t["mask"], c["rollout_rs"], c["rollout_rs_threshold"])
        close(kept, c["mask"], what)
        close_metrics(m, c["metrics"], what)
    assert any(0 < r["metrics"]["rollout_rs_masked_fraction"] < 1 for r in want["rs"])  # the cases reject some


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_the_mismatch_figures_equal_verls(case):
    from streamrl.learner import rollout_correction as rc

    t, want = corr_case(case)
    close_metrics(rc.offpolicy_metrics(t["logp"], t["old_logp"], t["mask"]), want["offpolicy"], case)


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_bypass_mode_losses_and_gradients_equal_verls_in_every_loss_agg_mode(case):
    """ppo_clip and reinforce, with and without weights and rejection. verl's loss aggregates
    over the mask left after rejection (its totals here, one micro-batch)."""
    from streamrl.learner import losses
    from streamrl.learner import rollout_correction as rc

    t, want = corr_case(case)
    for c in want["bypass"]:
        cfg = config.RolloutCorrectionConfig(
            rollout_is=c["rollout_is"], rollout_is_threshold=str(c["rollout_is_threshold"]), rollout_rs=c["rollout_rs"],
            rollout_rs_threshold=None if c["rollout_rs_threshold"] is None else str(c["rollout_rs_threshold"]),
            bypass_mode=True, loss_type=c["loss_type"])
        what = f"{case} {c['loss_type']} is={c['rollout_is']} rs={c['rollout_rs']} {c['loss_agg_mode']}"
        logp = t["logp"].clone().requires_grad_(True)
        knobs = DATA["knobs"]
        pl, mask = rc.bypass_loss(t["old_logp"], logp, t["advantages"], t["mask"], cfg, knobs["clip_ratio_low"],
                                  knobs["clip_ratio_high"], knobs["clip_ratio_c"])
        loss = losses.aggregate(pl.loss, mask, c["loss_agg_mode"], scale=7)
        loss.backward()
        close(loss, c["loss"], what)
        close(logp.grad, c["grad"], f"{what} gradient")
        corr = rc.correct(logp.detach(), t["old_logp"], t["mask"], cfg)
        close_metrics(corr.metrics, c["metrics"], what)


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_decoupled_correction_is_the_loss_times_verls_weights_on_the_kept_tokens(case):
    """Decoupled mode: verl's vanilla loss with ``rollout_is_weights`` on the rejection's mask;
    the trainer passes the same to ``policy_loss``."""
    from streamrl.learner import losses
    from streamrl.learner import rollout_correction as rc

    t, want = corr_case(case)
    c = next(x for x in want["bypass"] if x["loss_type"] == "reinforce" and x["rollout_rs"] == "seq_mean_k3"
             and x["loss_agg_mode"] == "token-mean")
    cfg = config.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="1.2", rollout_rs="seq_mean_k3",
                                         rollout_rs_threshold="0.03", loss_type="reinforce", bypass_mode=True)
    corr = rc.correct(t["logp"], t["old_logp"], t["mask"], cfg)
    logp = t["logp"].clone().requires_grad_(True)
    # reinforce with old = logp's own values: -A log pi w, exactly what bypass's reinforce computes
    pl = losses.policy_loss("gpg", t["old_logp"], logp, t["advantages"], corr.mask, losses.LossOptions(), corr.weights)
    loss = losses.aggregate(pl.loss, corr.mask, "token-mean")
    loss.backward()
    close(loss, c["loss"], case)
    close(logp.grad, c["grad"], f"{case} gradient")


# -- GDPO --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_gdpo_equals_verls(case):
    """Three components (one flat in a group), equal and given weights; the components are
    read in fp32 as verl reads them."""
    t, want = tensors(case), DATA["cases"][case]["gdpo"]
    comps = torch.tensor(list(zip(*want["components"].values())), dtype=torch.float64)
    for c in want["advantages"]:
        opt = losses.AdvantageOptions(reward_components=comps, gdpo_reward_weights=c["weights"] or ())
        ours = losses.ADV_ESTIMATORS["gdpo"](torch.zeros_like(t["mask"]), t["mask"], t["index"], opt)
        close(ours, c["advantages"], f"{case} gdpo weights={c['weights']}")


# -- ReMax -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_remax_equals_verls(case):
    t, want = tensors(case), DATA["cases"][case]["remax"]
    opt = losses.AdvantageOptions(reward_baselines=torch.tensor(want["baselines"], dtype=torch.float64))
    ours = losses.ADV_ESTIMATORS["remax"](losses.token_rewards(t["scores"], t["mask"]), t["mask"], t["index"], opt)
    close(ours, want["advantages"], f"{case} remax")


# -- GAE and the critic's value loss -------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_gae_equals_verls(case):
    """Token rewards on every token (a penalty) and the score on the last, a masked token inside
    a response (its value and TD error carried over), three (gamma, lambda)."""
    t, want = tensors(case), DATA["cases"][case]["gae"]
    rewards, values = (torch.tensor(want[k], dtype=torch.float64) for k in ("rewards", "values"))
    for c in want["gae"]:
        adv, ret = losses.gae_advantages_returns(rewards, values, t["mask"], c["gamma"], c["lam"])
        close(adv, c["advantages"], f"{case} gae {c['gamma']} {c['lam']} advantages")
        close(ret, c["returns"], f"{case} gae {c['gamma']} {c['lam']} returns")
        opt = losses.AdvantageOptions(gamma=c["gamma"], lam=c["lam"], values=values)
        close(losses.ADV_ESTIMATORS["gae"](rewards, t["mask"], t["index"], opt), c["advantages"], f"{case} registry")


@pytest.mark.parametrize("case", sorted(DATA["cases"]))
def test_the_value_loss_and_its_gradient_equal_verls_in_every_loss_agg_mode(case):
    t, want = tensors(case), DATA["cases"][case]["gae"]
    values = torch.tensor(want["values"], dtype=torch.float64)
    returns = torch.tensor(want["gae"][1]["returns"], dtype=torch.float64)
    assert set(want["value_loss"]) == set(config.LOSS_AGG_MODES)
    for agg, theirs in want["value_loss"].items():
        vpreds = torch.tensor(want["vpreds"], dtype=torch.float64, requires_grad=True)
        loss, clipped = losses.value_loss(vpreds, returns, values, t["mask"], DATA["cliprange_value"], agg, scale=7)
        loss.backward()
        close(loss, theirs["loss"], f"{case} {agg} vf_loss")
        close(vpreds.grad, theirs["grad"], f"{case} {agg} gradient")
        close(losses.aggregate(clipped, t["mask"], "token-mean"), theirs["clipfrac"], f"{case} {agg} vf_clipfrac")
    assert any(v["clipfrac"] > 0 for v in want["value_loss"].values())  # the clip is exercised
