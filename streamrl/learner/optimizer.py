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

if TYPE_CHECKING:
    import torch

    from streamrl.learner.config import OptimizerConfig

#: torch.optim's classes a config may name without torch being imported to check it
KNOWN = ("AdamW", "Adam", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD", "Rprop")
#: Megatron's names (verl's megatron ``optim.optimizer``): the torch class and its fixed keywords
MEGATRON = {"adam": ("AdamW", {}), "sgd": ("SGD", {"momentum": 0.9})}


def optimizer_class(name: str) -> tuple[str, dict[str, Any]]:
    """The torch.optim class that verl's ``optim.optimizer`` ``name`` means, and the keywords its
    name fixes (Megatron's ``sgd``: momentum 0.9); ``ValueError`` naming the choices for another."""
    if name in MEGATRON:
        return MEGATRON[name]
    if name in KNOWN:
        return name, {}
    try:
        import torch
    except ImportError:  # (no torch: the learner cannot run here; it checks the name at start)
        return name, {}
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return name, {}
    raise ValueError(f"a torch.optim optimizer ({', '.join(KNOWN)}, ...) or Megatron's adam / sgd; "
                     "Megatron's muon, 8-bit and other libraries' optimizers are not built in")


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
