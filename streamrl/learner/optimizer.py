"""The optimizer of the policy and of the critic (verl's ``optim.*``, ``learner.OptimizerConfig``):
built as verl's ``build_optimizer`` builds it, and stepped as verl steps it (the gradients clipped
to ``grad_clip``; a non-finite norm skips the step instead of poisoning the moments).

verl's FSDP engine names a class of ``optim.optimizer_impl`` (``torch.optim`` by default) and
passes ``lr``, ``weight_decay``, ``betas`` (to an optimizer whose name holds "adam" or
"ademamix") and ``override_optimizer_config``; its Megatron engine names ``adam`` (Adam with
decoupled weight decay, which is torch's AdamW) or ``sgd`` (momentum 0.9, Megatron's default).
Any other name fails at start, naming the field.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

from streamrl.learner.config import optimizer_class

if TYPE_CHECKING:
    import torch

    from streamrl.learner.config import OptimizerConfig


def build_optimizer(params: Iterable["torch.nn.Parameter"], opt: "OptimizerConfig") -> "torch.optim.Optimizer":
    """verl's ``build_optimizer``: ``lr``, ``weight_decay``, ``betas`` where the name holds "adam",
    then ``override_optimizer_config`` over them."""
    import torch

    name, fixed = optimizer_class(opt.optimizer)
    kwargs: dict[str, Any] = {"lr": opt.lr, "weight_decay": opt.weight_decay, **fixed}
    if "adam" in name.lower() or "ademamix" in name.lower():
        kwargs["betas"] = tuple(float(b) for b in opt.betas)
    kwargs.update(dict(opt.override_optimizer_config or {}))
    return getattr(torch.optim, name)(list(params), **kwargs)


def clip_and_step(params: list["torch.nn.Parameter"], optimizer: "torch.optim.Optimizer", grad_clip: float) -> float:
    """Clip the gradients to ``grad_clip`` (0: only measure them) and step; as verl, a
    non-finite gradient norm skips the step and drops the gradients. Returns the norm."""
    import torch

    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm
