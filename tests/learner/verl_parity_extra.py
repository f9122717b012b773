"""Writes ``tests/learner/verl_parity_extra_data.py``: what verl's own functions return for the parts
issue 48 added (GSPO and the losses that fix their aggregation in every ``loss_agg_mode``, the
learning-rate schedules, ...), for ``tests/learner/test_learner_parity_extra.py`` to compare streamrl's
against. Numbers are facts about verl; none of its code is in streamrl. Same inputs as
``tests/learner/verl_parity.py`` (its ``inputs``), same way to run it::

    pip install --no-deps --target /tmp/verl-deps tensordict pyvers codetiming
    PYTHONPATH=/tmp/verl-deps:. .venv/bin/python tests/learner/verl_parity_extra.py
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import torch

from tests.learner.verl_parity import AGG_MODES, CASES, KNOBS, inputs

OUT = Path(__file__).parent / "verl_parity_extra_data.py"

#: the losses compared in every loss_agg_mode (verl 0.9.1: gspo follows it, sapo and geo_mean fix theirs)
AGG_LOSSES = ["gspo", "sapo", "geo_mean", "vanilla"]
#: learning-rate schedules: (lr_scheduler_type, lr_warmup_steps, lr_warmup_steps_ratio, min_lr_ratio, num_cycles, total)
SCHEDULES = [("constant", 0, 0.0, 0.0, 0.5, 20), ("constant", 3, 0.0, 0.0, 0.5, 20), ("constant", -1, 0.25, 0.0, 0.5, 20),
             ("cosine", 0, 0.0, 0.0, 0.5, 20), ("cosine", 4, 0.0, 0.1, 0.5, 20), ("cosine", -1, 0.1, 0.0, 1.5, 30),
             ("cosine", 2, 0.0, 0.5, 0.25, 7)]


def _actor(mode: str, agg: str, **more):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=KNOBS["clip_ratio_low"],
                       clip_ratio_high=KNOBS["clip_ratio_high"], clip_ratio_c=KNOBS["clip_ratio_c"],
                       tau_pos=KNOBS["tau_pos"], tau_neg=KNOBS["tau_neg"], ppo_mini_batch_size=8,
                       ppo_micro_batch_size_per_gpu=8, rollout_n=1, loss_agg_mode=agg,
                       policy_loss=PolicyLossConfig(loss_mode=mode), **more)


def losses_in_every_mode(ca, t: dict) -> dict:
    out: dict = {}
    for mode in AGG_LOSSES:
        for agg in AGG_MODES:
            logp = t["logp"].clone().requires_grad_(True)
            cfg = _actor(mode, agg, global_batch_info={"loss_scale_factor": 7} if agg.endswith("norm") else {})
            loss, _ = ca.get_policy_loss_fn(mode)(old_log_prob=t["old_logp"], log_prob=logp,
                                                  advantages=t["advantages"], response_mask=t["mask"],
                                                  loss_agg_mode=agg, config=cfg)
            loss.backward()
            out[f"{mode}/{agg}"] = {"loss": float(loss), "grad": logp.grad.tolist()}
    return out


#: rollout correction: (rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
IS_CASES = [("token", 1.2, False), ("token", "0.8_1.25", False), ("token", 1.2, True), ("sequence", 1.5, False),
            ("sequence", "0.6_1.6", False), ("sequence", 1.5, True)]
#: (rollout_rs, rollout_rs_threshold): every option, a lone k1 bound, and two options chained
RS_CASES = [("token_k1", "0.8_1.25"), ("token_k1", 1.3), ("token_k2", 0.02), ("token_k3", 0.02),
            ("seq_sum_k1", "0.6_1.6"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1), ("seq_mean_k1", "0.9_1.1"),
            ("seq_mean_k2", 0.03), ("seq_mean_k3", 0.03), ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
            ("token_k1,seq_mean_k3", "0.8_1.25,0.03")]
#: bypass mode: (loss_type, rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold), each in every agg mode
BYPASS_CASES = [("ppo_clip", None, 2.0, None, None), ("ppo_clip", "token", 1.2, "seq_mean_k3", 0.03),
                ("reinforce", "token", 1.2, "seq_mean_k3", 0.03), ("reinforce", "sequence", 1.5, "token_k1", "0.8_1.25"),
                ("reinforce", None, 2.0, None, None)]


def rollout_correction(t: dict) -> dict:
    """verl's rollout_corr_helper on ``logp`` (the training policy) against ``old_logp`` (the
    rollout's), and its bypass-mode loss."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos as ca
    from verl.trainer.ppo import rollout_corr_helper as rc
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    logp, behav, mask = t["logp"], t["old_logp"], t["mask"]
    out: dict = {"is": [], "rs": [], "offpolicy": rc.compute_offpolicy_metrics(logp, behav, mask), "bypass": []}
    for level, threshold, norm in IS_CASES:
        w, m = rc.compute_rollout_correction_weights(logp - behav, mask, level, threshold, norm)
        out["is"].append({"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": norm,
                          "weights": w.tolist(), "metrics": m})
    for options, threshold in RS_CASES:
        kept, m = rc.compute_rollout_rejection_mask(logp - behav, mask, options, threshold)
        out["rs"].append({"rollout_rs": options, "rollout_rs_threshold": threshold, "mask": kept.tolist(),
                          "metrics": m})
    for loss_type, level, is_thr, rs, rs_thr in BYPASS_CASES:
        for agg in AGG_MODES:
            corr = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=is_thr, rollout_rs=rs,
                                           rollout_rs_threshold=rs_thr, bypass_mode=True, loss_type=loss_type)
            cfg = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=KNOBS["clip_ratio_low"],
                              clip_ratio_high=KNOBS["clip_ratio_high"], clip_ratio_c=KNOBS["clip_ratio_c"],
                              ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, rollout_n=1, loss_agg_mode=agg,
                              policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr),
                              global_batch_info={"loss_scale_factor": 7} if agg.endswith("norm") else {})
            x = logp.clone().requires_grad_(True)
            loss, m = ca.get_policy_loss_fn("bypass_mode")(old_log_prob=behav, log_prob=x, advantages=t["advantages"],
                                                           response_mask=mask, loss_agg_mode=agg, config=cfg)
            loss.backward()
            out["bypass"].append({"loss_type": loss_type, "rollout_is": level, "rollout_is_threshold": is_thr,
                                  "rollout_rs": rs, "rollout_rs_threshold": rs_thr, "loss_agg_mode": agg,
                                  "loss": float(loss), "grad": x.grad.tolist(),
                                  "metrics": {k: v for k, v in m.items() if k.startswith("rollout_corr/")}})
    return out


#: GDPO: weights per case (None: verl's equal weights)
GDPO_WEIGHTS = [None, [1.0, 0.3, 2.0]]


def gdpo(t: dict, index: list[str], seed: int) -> dict:
    """verl's ``compute_gdpo_outcome_advantage`` on three reward components (a binary format
    reward, a graded accuracy, a gaussian one; one group flat in the first), read as verl reads
    them (``non_tensor_batch``, each on its response's last token)."""
    import numpy as np
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as ca

    mask = t["mask"]
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed + 100)
    comps = {"format": (torch.rand(B, generator=g) > 0.4).double(),
             "accuracy": torch.randint(0, 3, (B,), generator=g).double() / 2,
             "length": torch.randn(B, generator=g, dtype=torch.float64)}
    first = index.count(index[0])
    comps["format"][:first] = 1.0  # the first group has no variance in it
    lengths = (T - torch.flip(mask, [1]).argmax(1))  # the response's real length (its last kept token + 1)
    P = 3
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), (torch.arange(T)[None, :] < lengths[:, None]).long()], 1)
    out = {"components": {k: v.tolist() for k, v in comps.items()}, "advantages": []}
    for weights in GDPO_WEIGHTS:
        algo = AlgoConfig(norm_adv_by_std_in_grpo=True, gdpo_reward_keys=list(comps),
                          gdpo_reward_weights=weights)
        adv, _ = ca.get_adv_estimator_fn("gdpo")(
            token_level_rewards=torch.zeros_like(mask), response_mask=mask, index=np.array(index, dtype=object),
            config=algo, non_tensor_batch={k: v.numpy() for k, v in comps.items()},
            batch={"prompts": torch.zeros(B, P), "attention_mask": attention})
        out["advantages"].append({"weights": weights, "advantages": adv.tolist()})
    return out


def remax(t: dict, index: list[str], seed: int) -> dict:
    """verl's ``compute_remax_outcome_advantage``: each score on its response's last token less
    the group's greedy response's reward (one per group)."""
    from verl.trainer.ppo import core_algos as ca

    mask = t["mask"]
    g = torch.Generator().manual_seed(seed + 200)
    groups = list(dict.fromkeys(index))
    per_group = torch.rand(len(groups), generator=g, dtype=torch.float64)
    baselines = torch.stack([per_group[groups.index(i)] for i in index])
    last = mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(last)), last] = t["scores"]
    adv, returns = ca.get_adv_estimator_fn("remax")(token_level_rewards=rewards, reward_baselines=baselines,
                                                    response_mask=mask)
    return {"baselines": baselines.tolist(), "advantages": adv.tolist(), "returns": returns.tolist()}


#: GAE: (gamma, lam)
GAE_CASES = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]
CLIPRANGE_VALUE = 0.2


def gae_and_value_loss(t: dict, seed: int) -> dict:
    """verl's ``compute_gae_advantage_return`` (token rewards with a KL-like penalty on every
    token, values of a critic) and ``compute_value_loss`` in every loss_agg_mode, with its
    gradient."""
    from verl.trainer.ppo import core_algos as ca

    mask = t["mask"]
    g = torch.Generator().manual_seed(seed + 300)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.5 * mask
    last = mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(1)
    rewards = -0.01 * torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
    rewards[torch.arange(len(last)), last] += t["scores"]
    out: dict = {"values": values.tolist(), "rewards": rewards.tolist(), "gae": [], "value_loss": {}}
    for gamma, lam in GAE_CASES:
        adv, ret = ca.get_adv_estimator_fn("gae")(token_level_rewards=rewards, values=values, response_mask=mask,
                                                  gamma=gamma, lam=lam)
        out["gae"].append({"gamma": gamma, "lam": lam, "advantages": adv.tolist(), "returns": ret.tolist()})
    returns = torch.tensor(out["gae"][1]["returns"], dtype=torch.float64)
    vpreds0 = values + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.3
    out["vpreds"] = vpreds0.tolist()
    for agg in AGG_MODES:
        vpreds = vpreds0.clone().requires_grad_(True)
        loss, clipfrac = ca.compute_value_loss(vpreds, returns, values, mask, CLIPRANGE_VALUE, loss_agg_mode=agg,
                                               loss_scale_factor=7 if agg.endswith("norm") else None)
        loss.backward()
        out["value_loss"][agg] = {"loss": float(loss), "grad": vpreds.grad.tolist(), "clipfrac": float(clipfrac)}
    return out


def schedules() -> list[dict]:
    """Each schedule's learning rate at steps 0..total (verl's engine: warm-up steps from the
    ratio when ``lr_warmup_steps`` <= 0; one scheduler step per training step)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    out = []
    for kind, warmup, ratio, min_lr, cycles, total in SCHEDULES:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        steps = warmup if warmup > 0 else int(ratio * total)
        if kind == "constant":
            sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=steps)
        else:
            sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=steps, num_training_steps=total,
                                                    min_lr_ratio=min_lr, num_cycles=cycles)
        lrs = []
        for _ in range(total + 1):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        out.append({"lr_scheduler_type": kind, "lr_warmup_steps": warmup, "lr_warmup_steps_ratio": ratio,
                    "min_lr_ratio": min_lr, "num_cycles": cycles, "versions": total, "lr": 1e-3, "lrs": lrs})
    return out


def main() -> None:
    import verl
    from verl.trainer.ppo import core_algos as ca

    source = Path(inspect.getfile(ca)).read_bytes()
    out: dict = {"verl": verl.__version__, "core_algos_sha256": hashlib.sha256(source).hexdigest(),
                 "knobs": KNOBS, "cliprange_value": CLIPRANGE_VALUE, "schedules": schedules(), "cases": {}}
    for name, (sizes, T, seed) in CASES.items():
        case = inputs(sizes, T, seed)
        t = {k: torch.tensor(v, dtype=torch.float64) for k, v in case.items() if k != "index"}
        out["cases"][name] = {"inputs": case, "agg_losses": losses_in_every_mode(ca, t),
                             "rollout_correction": rollout_correction(t),
                             "gdpo": gdpo(t, case["index"], seed), "remax": remax(t, case["index"], seed),
                             "gae": gae_and_value_loss(t, seed)}
    OUT.write_text(f'"""What verl {verl.__version__}\'s own functions returned (tests/learner/verl_parity_extra.py wrote this;\n'
                   f'tests/learner/test_learner_parity_extra.py reads it)."""\n\nDATA = {json.dumps(out)!r}\n')
    print(f"wrote {OUT} (verl {verl.__version__})")


if __name__ == "__main__":
    main()
