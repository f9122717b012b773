"""verl's entry modules: the ``python -m MODULE`` a launch script runs names the trainer, and a
recipe's trainer may train something else than verl's with the same keys (its own loss, its own
reward, its own config file's defaults). ``run.verl_entry`` (``streamrl run --verl-entry
MODULE``) says which one a script ran, so that its algorithm is the one trained or the run is
refused naming it, never verl's plain trainer in its place.

An entry streamrl knows is one of two things:

- trained: what it trains is verl's trainer with other defaults (its Hydra config file's values,
  ``defaults``: given before the script's keys, so a key the script gives wins, as in Hydra),
  maybe with the recipe's own loss, which the script selects by its keys as the recipe does; what
  the recipe's trainer cannot train otherwise (GVPO's actor raises on any other loss_mode) is
  ``requires``, checked on the resolved config (``entry_problems``);
- refused: its trainer changes the algorithm in ways streamrl has no counterpart for (``missing``).

A module not in ``ENTRIES`` is refused too: its trainer is unknown here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Entry", "ENTRIES", "entry_keys", "entry_problems", "VERL_MAIN"]

VERL_MAIN = "verl.trainer.main_ppo"


@dataclass(frozen=True)
class Entry:
    """One entry module: what its trainer trains (``trains``), its config file's values that differ
    from verl's (``defaults``, verl overrides), or what streamrl lacks for it (``missing``: refused)."""

    trains: str
    defaults: tuple[str, ...] = ()
    missing: str = ""
    #: (streamrl field, value it must have, the verl key that sets it): the recipe's trainer trains nothing else
    requires: tuple[tuple[str, str, str], ...] = ()


_DAPO_REWARD = "DAPO's trainer (dynamic sampling: algorithm.filter_groups; the dapo reward manager's overlong buffer)"

#: the entry modules of verl and of verl-recipe's launch scripts (verl-project/verl-recipe 48ea0a7)
ENTRIES: dict[str, Entry] = {
    VERL_MAIN: Entry("verl's PPO trainer"),
    "verl.trainer.main_ppo_v0": Entry("verl's PPO trainer (its earlier task runner)"),
    # recipe/dapo/config/dapo_trainer.yaml over ppo_trainer: the dapo reward manager, DAPO's project name
    "recipe.dapo.main_dapo": Entry(_DAPO_REWARD, ("reward.reward_manager.name=dapo", "trainer.project_name=verl-dapo")),
    "recipe.dapo.dapo_transfer_queue.main_dapo": Entry(
        _DAPO_REWARD + " over verl's transfer queue",
        ("reward_model.reward_manager=dapo", "trainer.project_name=verl-dapo-transferqueue")),
    # recipe/gvpo/config/gvpo_trainer.yaml over ppo_trainer: actor.gvpo_beta 0.1, GVPO's project name (its actor
    # config class only adds gvpo_beta); its actor trains loss_mode gvpo alone (the policy loss "gvpo")
    "recipe.gvpo.gvpo_main_ppo": Entry(
        "GVPO", ("actor_rollout_ref.actor.gvpo_beta=0.1", "trainer.project_name=gvpo"),
        requires=(("learner.policy_loss.loss_mode", "gvpo", "actor_rollout_ref.actor.policy_loss.loss_mode"),)),
    "recipe.flowrl.main_flowrl": Entry("FlowRL", missing="FlowRL's flow-balance loss and its learned log-partition "
                                                         "head (recipe/flowrl)"),
    "recipe.prime.main_prime": Entry("PRIME", missing="PRIME's implicit process reward model, trained beside the "
                                                      "policy (recipe/prime)"),
    "recipe.sppo.main_sppo": Entry("SPPO", missing="SPPO's self-play preference loss (recipe/sppo: the squared gap "
                                                   "of the log-ratio and eta times the reward less its soft mean over "
                                                   "verl's whole training batch, where streamrl's statistics are a "
                                                   "mini-batch's)"),
    "recipe.spin.main_spin": Entry("SPIN", missing="SPIN's self-play fine-tuning against reference responses "
                                                   "(recipe/spin)"),
    "recipe.spo.spo_main_ppo": Entry("SPO", missing="SPO's single-stream trainer and its value tracker (recipe/spo)"),
    "recipe.entropy.main_entropy": Entry("the entropy mechanism recipe",
                                         missing="the entropy recipe's own reward (recipe/entropy/reward_score; give "
                                                 "it as custom_reward_function and run verl.trainer.main_ppo's keys)"),
    "recipe.partial_rollout.main_ppo": Entry("partial rollouts", missing="the partial-rollout recipe's step-"
                                             "synchronous trainer (streamrl's own: rollout.on_update=partial)"),
    "recipe.async_flow.grpo_main": Entry("AsyncFlow", missing="AsyncFlow's trainer over its transfer queue "
                                                              "(streamrl's stages stream: learner.max_staleness)"),
    "recipe.reward_queue.main": Entry("the reward queue", missing="the reward-queue recipe's fully-async trainer"),
    "recipe.dynamo.main_dynamo": Entry("NVIDIA Dynamo rollouts", missing="NVIDIA Dynamo as the rollout backend"),
    "recipe.atropos.main_atropos": Entry("Atropos", missing="Atropos environments behind its proxy"),
    "recipe.dance_grpo.main_dance": Entry("DanceGRPO", missing="diffusion models (DanceGRPO)"),
    "main_gkd": Entry("GKD", missing="the GKD recipe's Megatron trainer (streamrl's on-policy distillation: the "
                                     "distillation section)"),
}


def entry_keys(module: str) -> tuple[list[str], str]:
    """``(verl overrides its config file sets, problem)`` for entry module ``module`` (``""``:
    verl's own); the problem is "" where it is trained, else a line naming the module."""
    module = module.strip()
    if not module or module == VERL_MAIN:
        return [], ""
    entry = ENTRIES.get(module)
    if entry is None:
        return [], (f"run.verl_entry={module}: refused, an entry module streamrl does not know (its trainer may train "
                    f"something else than verl's; known: {', '.join(sorted(ENTRIES))})")
    if entry.missing:
        return [], f"run.verl_entry={module}: refused, streamrl has no counterpart for {entry.missing}"
    return list(entry.defaults), ""


def entry_problems(module: str, cfg: object) -> list[str]:
    """What the resolved pipeline config ``cfg`` sets that entry ``module``'s trainer cannot train
    (its ``requires``), one line each naming the module and the verl key; [] where it trains."""
    entry = ENTRIES.get(module.strip())
    problems = []
    for field, value, key in entry.requires if entry else ():
        got: object = cfg
        for part in field.split("."):
            got = getattr(got, part)
        if str(got) != value:
            problems.append(f"run.verl_entry={module}: its trainer trains {key}={value} only (got {got}, as "
                            f"{field}): refused rather than training another loss in its place")
    return problems
