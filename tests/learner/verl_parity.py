"""Writes ``tests/learner/verl_parity_data.py``: what verl's own ``core_algos`` functions return on
fixed tensors, for ``tests/learner/test_learner_parity.py`` to compare streamrl's against (issue 37).
Numbers are facts about verl; none of its code is in streamrl.

Run it where verl 0.9.1 imports (``make test`` installs it without dependencies; its
``core_algos`` also needs tensordict, pyvers and codetiming)::

    pip install --no-deps --target /tmp/verl-deps tensordict pyvers codetiming
    PYTHONPATH=/tmp/verl-deps .venv/bin/python tests/learner/verl_parity.py

The inputs are written beside the outputs, so the test needs neither verl nor this script. A
Python module, not a data file: nothing under tests/ but test code (``test_install``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).parent / "verl_parity_data.py"

#: two shapes: groups of 2, 3 and 3 over 6 tokens, and two groups of 4 over 4 tokens
CASES = {"mixed": ([2, 3, 3], 6, 0), "even": ([4, 4], 4, 1)}
ESTIMATORS = ["grpo", "grpo_dr", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline"]
LOSSES = ["vanilla", "gspo", "clip_cov", "kl_cov", "geo_mean", "cispo", "gpg", "sapo", "dppo_tv", "dppo_kl"]
AGG_MODES = ["token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KL_TYPES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "abs+"]
#: the loss knobs the losses are called with (verl's names; the cov ratios raised so that several
#: tokens are picked on tensors this small)
KNOBS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, clip_cov_ratio=0.2, clip_cov_lb=0.5,
             clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.1, tau_pos=1.0, tau_neg=1.05)
SEED = 1234  # torch's generator before each clip_cov call (it picks tokens at random)


def inputs(sizes: list[int], T: int, seed: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if T > 3:
        mask[1, 1] = 0.0  # a token the policy did not produce (tool output), inside a response
    scores = torch.randint(0, 3, (B,), generator=g).double() / 2 + torch.rand(B, generator=g, dtype=torch.float64) * 0.1
    scores[sizes[0]:sizes[0] + sizes[1]] = 0.5  # a group without variance
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    logp = logp.clamp(max=-1e-3)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5 * mask
    index = [f"g{i}" for i, n in enumerate(sizes) for _ in range(n)]
    return {"index": index, "mask": mask.tolist(), "scores": scores.tolist(), "old_logp": old.tolist(),
            "logp": logp.tolist(), "ref_logp": ref.tolist(), "advantages": adv.tolist()}


def main() -> None:
    import verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as ca
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    source = Path(inspect.getfile(ca)).read_bytes()
    out: dict = {"verl": verl.__version__, "core_algos_sha256": hashlib.sha256(source).hexdigest(),
                 "knobs": KNOBS, "seed": SEED, "cases": {}}
    for name, (sizes, T, seed) in CASES.items():
        case = inputs(sizes, T, seed)
        results: dict = {}
        for dtype in ("float64", "float32"):
            dt = getattr(torch, dtype)
            t = {k: torch.tensor(v, dtype=dt) for k, v in case.items() if k != "index"}
            mask, index = t["mask"], np.array(case["index"], dtype=object)
            last = (mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(1))
            token_rewards = torch.zeros_like(mask)
            token_rewards[torch.arange(len(last)), last] = t["scores"]
            res: dict = {"advantages": {}, "losses": {}, "agg": {}, "kl": {}}
            for est in ESTIMATORS:
                real = "grpo" if est == "grpo_dr" else est
                algo = AlgoConfig(gamma=1.0, norm_adv_by_std_in_grpo=est != "grpo_dr")
                fn = ca.get_adv_estimator_fn(real)
                kw = dict(token_level_rewards=token_rewards.clone(), response_mask=mask, config=algo)
                if real not in ("reinforce_plus_plus",):
                    kw["index"] = index
                if real == "grpo":
                    kw["norm_adv_by_std_in_grpo"] = est != "grpo_dr"
                adv, _ = fn(**kw)
                res["advantages"][est] = adv.tolist()
            for mode in LOSSES:
                cfg = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=KNOBS["clip_ratio_low"],
                                  clip_ratio_high=KNOBS["clip_ratio_high"], clip_ratio_c=KNOBS["clip_ratio_c"],
                                  tau_pos=KNOBS["tau_pos"], tau_neg=KNOBS["tau_neg"], ppo_mini_batch_size=8,
                                  ppo_micro_batch_size_per_gpu=8, rollout_n=1,
                                  policy_loss=PolicyLossConfig(loss_mode=mode, clip_cov_ratio=KNOBS["clip_cov_ratio"],
                                                               clip_cov_lb=KNOBS["clip_cov_lb"],
                                                               clip_cov_ub=KNOBS["clip_cov_ub"],
                                                               kl_cov_ratio=KNOBS["kl_cov_ratio"],
                                                               ppo_kl_coef=KNOBS["ppo_kl_coef"]))
                logp = t["logp"].clone().requires_grad_(True)
                torch.manual_seed(SEED)
                loss, metrics = ca.get_policy_loss_fn(mode)(old_log_prob=t["old_logp"], log_prob=logp,
                                                            advantages=t["advantages"], response_mask=mask,
                                                            loss_agg_mode="token-mean", config=cfg)
                loss.backward()
                res["losses"][mode] = {"loss": float(loss), "grad": logp.grad.tolist(),
                                       "clipfrac": float(metrics.get("actor/pg_clipfrac", 0.0))}
            values = t["logp"] * t["advantages"]
            for agg in AGG_MODES:
                res["agg"][agg] = float(ca.agg_loss(values, mask, agg, loss_scale_factor=7 if agg.endswith("norm") else None))
            for kind in KL_TYPES:
                logp = t["logp"].clone().requires_grad_(True)
                kl = ca.kl_penalty(logp, t["ref_logp"], kind)
                (kl * mask).sum().backward()
                res["kl"][kind] = {"value": kl.tolist(), "grad": logp.grad.tolist()}
            results[dtype] = res
        out["cases"][name] = {"inputs": case, "results": results}
    OUT.write_text(f'"""What verl {verl.__version__}\'s own functions returned (tests/learner/verl_parity.py wrote this;\n'
                   f'tests/learner/test_learner_parity.py reads it)."""\n\nDATA = {json.dumps(out)!r}\n')
    print(f"wrote {OUT} (verl {verl.__version__})")


if __name__ == "__main__":
    main()
