"""The critic of ``adv_estimator: gae`` (verl's ``critic.*``): a value model trained beside the
policy, in the learner's own processes.

Why there and not in a stage of its own: the critic needs exactly what the policy's update has
(the mini-batch's token ids, its rewards, the same micro-batches and the same FSDP group), at the
same moment (its values are computed at the update, before the advantages), and nothing else
reads it. A stage of its own would send every mini-batch twice over Kafka and add a round trip
to every update, for no consumer; in the learner it is one more model in the same processes.

The model is the policy's architecture (``critic.model``, or the policy's weights) with its
output head replaced by one value per position; sharded with FSDP2 as the policy is, with its
own optimizer and schedule (``learner.critic``'s ``optim`` fields, verl's ``critic.optim.*``), its
own micro-batches and CPU offload, and its own sharded checkpoint (``critic_dcp/``), which loads
on any rank count. Its
loss is verl's ``compute_value_loss`` (``losses.value_loss``), aggregated over the mini-batch
as the policy loss is (exact over micro-batches and ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from streamrl.learner import losses
from streamrl.learner import optimizer as optim

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig


def value_model(cfg: "LearnerConfig", device: str) -> Any:
    """The policy's architecture with one value per position: ``critic.model`` (or the policy)
    loaded, its output head replaced by a fresh ``hidden -> 1`` linear layer (verl's critic is a
    token-classification model with one label: the same)."""
    from streamrl.policy import load_policy, model_overrides

    model, _ = load_policy(cfg.critic.model or cfg.policy, device=device, dtype=cfg.dtype, seed=cfg.seed,
                           overrides=model_overrides(cfg.critic.override_config),
                           where="learner.critic.override_config")
    hidden = model.get_output_embeddings().weight.shape[-1]
    head = torch.nn.Linear(hidden, 1, bias=False, device=device, dtype=getattr(torch, cfg.dtype))
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * getattr(model.config, "initializer_range", 0.02))
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(head)
    return model


class Critic:
    """One rank's critic: values of the response tokens, and its update on returns."""

    def __init__(self, cfg: "LearnerConfig", device: torch.device, sharded: bool):
        self.cfg = cfg
        self.device = device
        self.model = value_model(cfg, str(device))
        self.model.to(dtype=getattr(torch, cfg.dtype))
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.sharded = sharded
        if sharded:
            from streamrl.learner import distributed

            distributed.shard(self.model, cfg, offload=cfg.critic.cpu_offload)
        self.model.train()
        self.optimizer = optim.build_optimizer(self.model.parameters(), cfg.critic)

    def forward(self, batch: Any) -> torch.Tensor:  # batch: a collate.Batch
        """Values ``[B, R]``: the value at the position that predicts each response token (the
        state before it, as verl's ``values[:, -R - 1:-1]``); 0 on padding."""
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0].float()
        where = batch.valid.nonzero(as_tuple=True)
        zeros = torch.zeros(batch.valid.shape, device=out.device, dtype=out.dtype)
        return zeros.index_put(where, out[where[0], batch.positions[where]])

    @torch.no_grad()
    def values(self, units: list[Any]) -> list[torch.Tensor]:
        return [self.forward(b) for b in units]

    def update(self, units: list[Any], returns: list[torch.Tensor], old_values: list[torch.Tensor],
               agg: dict[str, Any], tok: dict[str, Any], world: int,
               add: Callable[[str, torch.Tensor], None]) -> float:
        """``critic.ppo_epochs`` optimizer steps on the clipped value loss over the mini-batch
        (every rank its units, each normalised by the mini-batch's totals); the metrics go to
        ``add`` (summed over the ranks); returns the last gradient norm."""
        c, cfg = self.cfg.critic, self.cfg
        mode = c.loss_agg_mode or cfg.loss_agg_mode
        grad_norm = 0.0
        for _ in range(c.ppo_epochs or cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for u, mb in enumerate(units):
                vpreds = self.forward(mb)
                loss, clipped = losses.value_loss(vpreds, returns[u], old_values[u], mb.mask, c.cliprange_value,
                                                  mode, **agg)
                (loss * world if self.sharded else loss).backward()
                add("critic/vf_loss", loss)
                add("critic/vf_clipfrac", losses.aggregate(clipped, mb.mask, "token-mean", **tok))
                add("critic/vpred_mean", losses.aggregate(vpreds.detach(), mb.mask, "token-mean", **tok))
            grad_norm = optim.clip_and_step(list(self.model.parameters()), self.optimizer, c.grad_clip)
        return grad_norm

    # -- checkpoint ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        out = {"model": get_model_state_dict(self.model)}
        if self.optimizer.state:  # (a fresh optimizer's state would take a step to ask for)
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return out

    def save(self, directory: Path) -> None:
        """Each rank its shard of the critic and its AdamW states, into ``directory``."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(), checkpoint_id=str(directory))

    def load(self, directory: Path) -> None:
        """From shards written by any number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                             set_model_state_dict, set_state_dict)

        saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        if any(k.startswith("optim.") for k in saved):
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(directory))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=str(directory))
            set_model_state_dict(self.model, state["model"])
