"""The learning-rate schedule over versions (verl's ``optim.*``), the policy's and the critic's,
as a pure function of the policy version: a version is verl's training step (one scheduler step
per step, the first update at step 0), so the rate at version ``v`` is verl's after ``v``
scheduler steps. Being a function of the version alone, it carries across a resume (the version
is in every checkpoint) and across rank counts with nothing more to save.

Two families, as verl's engines have: FSDP's ``lr_scheduler_type`` (constant or cosine after a
linear warm-up from 0: verl's ``get_constant_schedule_with_warmup`` /
``get_cosine_schedule_with_warmup``), and Megatron's ``lr_decay_style`` (constant, linear,
cosine, inverse-square-root, WSD after a linear warm-up from ``lr_warmup_init``: Megatron-Core's
``OptimizerParamScheduler`` as verl's ``get_megatron_optimizer_param_scheduler`` sets it up),
taken when ``lr_decay_style`` is set. Megatron's weight-decay schedule is left out: verl gives it
the same start and end (``weight_decay``), so it is constant whatever its style.

``tests/learner/test_learner_parity_extra.py`` and ``tests/learner/test_learner_optim.py``
compare them with verl 0.9.1's functions at every version.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from streamrl.learner.config import OptimizerConfig


def _total(opt: "OptimizerConfig", total: int | None) -> int:
    return int(getattr(opt, "versions", 0) if total is None else total)


def warmup_versions(opt: "OptimizerConfig", total: int | None = None) -> int:
    """verl's rule: ``lr_warmup_steps`` when > 0, else ``int(lr_warmup_steps_ratio * total)``
    (Megatron's: of ``lr_decay_steps``, which defaults to the total)."""
    if opt.lr_warmup_steps > 0:
        return int(opt.lr_warmup_steps)
    base = (opt.lr_decay_steps or _total(opt, total)) if opt.lr_decay_style else _total(opt, total)
    return int(opt.lr_warmup_steps_ratio * base)


def lr_factor(opt: "OptimizerConfig", version: int, total: int | None = None) -> float:
    """FSDP's schedule: the multiple of ``opt.lr`` the update towards version ``version + 1``
    uses; ``total``: the run's versions (the policy's config: its own ``versions``)."""
    total = _total(opt, total)
    warmup = warmup_versions(opt, total)
    if opt.lr_scheduler_type == "constant":
        return float(version) / float(max(1.0, warmup)) if version < warmup else 1.0
    step = version if opt.zero_indexed_step else version + 1
    if step < warmup:  # cosine: linear warm-up from 0 (verl's init_lr_ratio 0)
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    low = opt.min_lr_ratio
    x = math.cos(math.pi * float(opt.num_cycles) * 2.0 * progress)
    return max(low, x * (1 - low) * 0.5 + (1 + low) * 0.5)


def megatron_lr(opt: "OptimizerConfig", version: int, total: int | None = None) -> float:
    """Megatron's schedule (``lr_decay_style``): the rate after ``version`` scheduler steps."""
    decay = opt.lr_decay_steps or _total(opt, total)
    warmup = warmup_versions(opt, total)
    top, low, n = opt.lr, opt.min_lr, version
    if warmup > 0 and n <= warmup:
        return opt.lr_warmup_init + (top - opt.lr_warmup_init) * float(n) / float(warmup)
    style = opt.lr_decay_style
    if style == "constant":
        return top
    if n > decay:
        return low
    if style == "inverse-square-root":
        return max(low, top * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = float(n - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: stable, then an anneal over the last lr_wsd_decay_steps
        start = decay - opt.lr_wsd_decay_steps
        if n <= start:
            coeff = 1.0
        else:
            r = float(n - start) / float(opt.lr_wsd_decay_steps)
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[opt.lr_wsd_decay_style]
    return low + coeff * (top - low)


def lr_at(opt: "OptimizerConfig", version: int, total: int | None = None) -> float:
    """The rate of the update towards version ``version + 1``."""
    if opt.lr_decay_style:
        return megatron_lr(opt, version, total)
    return opt.lr * lr_factor(opt, version, total)


def data_versions(rows: int, epochs: int, per_version: int) -> int:
    """The schedule's total where ``learner.versions`` is 0 and the run ends with the data:
    verl's ``total_training_steps`` when it is null, ``len(train_dataloader) * total_epochs``,
    its train dataloader dropping each epoch's last partial batch (``drop_last=True``), so
    ``rows // per_version`` steps an epoch (``rows``: the dataset's prompts after
    ``max_prompt_length``'s filter, as verl's dataset counts them; ``per_version``: verl's
    train_batch_size, ``groups_per_mini_batch * mini_batches_per_version``). At least 1: verl
    refuses fewer rows than a batch, where the run here still trains one (partial) version."""
    return max(1, rows // per_version * epochs)
