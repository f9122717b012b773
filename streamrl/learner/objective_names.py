"""The objective's names, free of torch: a config is checked where torch is not installed
(``streamrl.learner.config``), and ``streamrl.learner.losses`` reads its modes from here too, so
the config may look a name up in the losses' registries (``config.registered``) without an
import circle.

``ADV_ESTIMATORS`` and ``LOSS_MODES`` are the built-in entries of the losses' registries
(``register_adv_est``, ``register_policy_loss``), which ``tests/learner/test_learner_parity.py`` checks
against them; the config takes one of them without importing torch, and looks any other name
up in the registries (one registered by the user's code).
"""

from __future__ import annotations

ADV_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline", "ppo", "gdpo", "remax", "gae")
LOSS_MODES = ("vanilla", "gspo", "clip_cov", "kl_cov", "geo_mean", "cispo", "gpg", "sapo", "dppo_tv", "dppo_kl",
              "gvpo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: the losses whose objective fixes their aggregation whatever ``loss_agg_mode`` says (as verl
#: 0.9.1's do): a config naming another mode is told so once at start (``start_notes``)
FIXED_AGG_MODES = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean", "gvpo": "seq-mean-token-sum"}
#: the losses that measure each sequence against statistics of its whole group (GVPO, a recipe of
#: verl-recipe's): they take no importance weight, so rollout correction and the decoupled
#: objective are refused with them (``LearnerConfig.validate``)
GROUP_LOSSES = ("gvpo",)
