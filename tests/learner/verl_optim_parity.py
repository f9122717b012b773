"""Writes ``tests/learner/verl_optim_parity_data.py``: what verl 0.9.1's own optimizer functions
return, for ``tests/learner/test_learner_optim.py`` to compare streamrl's against (issue 56).
Numbers are facts about verl; none of its code is in streamrl.

verl's functions called: ``verl.workers.config.optimizer.build_optimizer`` on its
``FSDPOptimizerConfig`` (the optimizer's class and its hyper-parameters), verl's
``get_cosine_schedule_with_warmup`` with ``zero_indexed_step`` false (the rate after each step),
and ``verl.utils.megatron.optimizer.get_megatron_optimizer_param_scheduler`` on its
``McoreOptimizerConfig`` (Megatron-Core's ``OptimizerParamScheduler``, stepped once per training
step as verl's Megatron actor steps it). Run it where verl 0.9.1 and megatron-core import::

    pip install --no-deps --target /tmp/verl-deps tensordict pyvers codetiming megatron-core
    PYTHONPATH=/tmp/verl-deps .venv/bin/python tests/learner/verl_optim_parity.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

OUT = Path(__file__).parent / "verl_optim_parity_data.py"

#: FSDP optimizer configs: (optimizer, betas, weight_decay, override_optimizer_config)
OPTIMIZERS = [("AdamW", (0.9, 0.999), 0.01, None), ("AdamW", (0.8, 0.95), 0.1, {"eps": 1e-6}),
              ("Adam", (0.85, 0.99), 0.0, None), ("SGD", (0.9, 0.999), 0.05, {"momentum": 0.5}),
              ("RMSprop", (0.9, 0.999), 0.02, None)]
#: cosine with zero_indexed_step false: (lr_warmup_steps, ratio, min_lr_ratio, num_cycles, total)
COSINE_ONE_INDEXED = [(2, 0.0, 0.0, 0.5, 10), (-1, 0.3, 0.1, 0.5, 12), (0, 0.0, 0.2, 1.0, 9)]
#: Megatron: (lr_decay_style, lr_warmup_steps, ratio, lr_warmup_init, min_lr, lr_decay_steps,
#: lr_wsd_decay_style, lr_wsd_decay_steps, total)
MEGATRON = [("constant", 3, 0.0, 1e-4, 0.0, None, "exponential", None, 10),
            ("linear", 2, 0.0, 0.0, 1e-4, None, "exponential", None, 10),
            ("linear", -1, 0.2, 2e-4, 0.0, 8, "exponential", None, 12),
            ("cosine", 0, 0.0, 0.0, 5e-5, None, "exponential", None, 9),
            ("cosine", 3, 0.0, 1e-5, 1e-4, 7, "exponential", None, 10),
            ("inverse-square-root", 2, 0.0, 0.0, 1e-4, None, "exponential", None, 10),
            ("inverse-square-root", 0, 0.0, 0.0, 0.0, None, "exponential", None, 6),
            *[("WSD", 1, 0.0, 0.0, 1e-4, None, style, 4, 10)
              for style in ("exponential", "linear", "cosine", "minus_sqrt")]]
LR = 1e-3


def optimizers() -> list[dict]:
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    out = []
    for name, betas, wd, override in OPTIMIZERS:
        cfg = FSDPOptimizerConfig(lr=LR, optimizer=name, betas=betas, weight_decay=wd,
                                  override_optimizer_config=override)
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
        group = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.param_groups[0].items()
                 if k != "params" and isinstance(v, (int, float, bool, tuple, type(None)))}
        out.append({"optimizer": name, "betas": list(betas), "weight_decay": wd,
                    "override_optimizer_config": override or {}, "class": type(opt).__name__, "group": group})
    return out


def cosine_one_indexed() -> list[dict]:
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    out = []
    for warmup, ratio, min_lr, cycles, total in COSINE_ONE_INDEXED:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        steps = warmup if warmup > 0 else int(ratio * total)
        sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=steps, num_training_steps=total,
                                                min_lr_ratio=min_lr, num_cycles=cycles, zero_indexed_step=False)
        lrs = []
        for _ in range(total + 1):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        out.append({"lr_scheduler_type": "cosine", "zero_indexed_step": False, "lr_warmup_steps": warmup,
                    "lr_warmup_steps_ratio": ratio, "min_lr_ratio": min_lr, "num_cycles": cycles, "versions": total,
                    "lr": LR, "lrs": lrs})
    return out


def megatron() -> list[dict]:
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler
    from verl.workers.config.optimizer import McoreOptimizerConfig

    out = []
    for style, warmup, ratio, init, min_lr, decay, wsd_style, wsd_steps, total in MEGATRON:
        cfg = McoreOptimizerConfig(lr=LR, lr_decay_style=style, lr_warmup_steps=warmup, lr_warmup_steps_ratio=ratio,
                                   lr_warmup_init=init, min_lr=min_lr, lr_decay_steps=decay,
                                   lr_wsd_decay_style=wsd_style, lr_wsd_decay_steps=wsd_steps,
                                   total_training_steps=total)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        sched = get_megatron_optimizer_param_scheduler(opt, cfg)
        lrs = []
        for _ in range(total + 1):
            lrs.append(opt.param_groups[0]["lr"])
            sched.step(1)
        out.append({"lr_decay_style": style, "lr_warmup_steps": warmup, "lr_warmup_steps_ratio": ratio,
                    "lr_warmup_init": init, "min_lr": min_lr, "lr_decay_steps": decay or 0,
                    "lr_wsd_decay_style": wsd_style, "lr_wsd_decay_steps": wsd_steps or 0, "versions": total,
                    "lr": LR, "lrs": lrs})
    return out


def main() -> None:
    import verl

    out = {"verl": verl.__version__, "optimizers": optimizers(), "cosine_one_indexed": cosine_one_indexed(),
           "megatron": megatron()}
    OUT.write_text(f'"""What verl {verl.__version__}\'s own optimizer functions returned (tests/learner/verl_optim_parity.py '
                   'wrote this;\ntests/learner/test_learner_optim.py reads it)."""\n\nDATA = ' + repr(json.dumps(out)) + "\n")
    print(f"wrote {OUT} (verl {verl.__version__})")


if __name__ == "__main__":
    main()
