"""verl's ``model.override_config`` (the model's config changed at load: the policy, its KL
reference, the critic, the rollout's engines) and ``trainer.critic_warmup`` (the critic trained
alone for the first versions), through the learner's own trainer on the tiny policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.errors import ConfigError
from streamrl.learner.schedule import lr_at
from streamrl.learner.trainer import Trainer
from streamrl.policy import apply_overrides, load_policy, model_overrides
from streamrl.weights import save_policy
from tests.helpers import batch, learner_cfg


def verl_function(path: str, name: str):
    """One function of the installed verl, compiled from its file alone (the module's imports
    need packages the tests do not install: tensordict, ...)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("verl")
    source = (Path(spec.submodule_search_locations[0]) / path).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {}
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return namespace[name]


def test_overrides_set_fields_and_sub_configs_as_verls_update_model_config(tmp_path):
    """verl's ``update_model_config`` on the same config and overrides gives the same config; the
    Megatron form (``model_config``) and the kernel's pick are read as verl reads them."""
    from transformers import Qwen2Config

    update_model_config = verl_function("utils/model.py", "update_model_config")
    from transformers import LlavaConfig

    overrides = {"max_position_embeddings": 512, "rms_norm_eps": 0.25, "attention_dropout": 0.1}
    ours, theirs = Qwen2Config(), Qwen2Config()
    apply_overrides(ours, overrides)
    update_model_config(theirs, overrides)
    assert ours.to_dict() == theirs.to_dict() and ours.max_position_embeddings == 512
    nested = {"text_config": {"max_position_embeddings": 1024}, "image_token_index": 7}  # a sub-config's fields
    ours, theirs = LlavaConfig(), LlavaConfig()
    apply_overrides(ours, nested)
    update_model_config(theirs, nested)
    assert ours.to_dict() == theirs.to_dict() and ours.text_config.max_position_embeddings == 1024
    # a plain mapping field (transformers 5's rope_parameters): its entries updated, where verl's
    # setattr on a dict raises
    ours = Qwen2Config()
    apply_overrides(ours, {"rope_parameters": {"rope_theta": 5000.0}})
    assert ours.rope_parameters["rope_theta"] == 5000.0 and ours.rope_parameters["rope_type"] == "default"
    assert model_overrides({"model_config": {"a": 1}, "b": 2}) == {"a": 1}
    assert model_overrides({"attn_implementation": "eager", "a": 1}) == {"a": 1}
    with pytest.raises(ConfigError, match="learner.override_config.nothing_here"):
        apply_overrides(Qwen2Config(), {"nothing_here": {"x": 1}}, "learner.override_config")


def test_the_policy_its_reference_and_the_critic_load_with_their_overrides(tmp_path):
    """A saved policy loaded with an override trains on the changed config (other log-probs); the
    KL reference has the policy's overrides, the critic its own; the rollout's transformers
    engine loads the same changed policy as the learner."""
    from streamrl.rollout.backends.transformers_engine import TransformersBackend

    model, tok = load_policy("tiny")
    policy = save_policy(model, tok, tmp_path / "policy")
    changed = {"rms_norm_eps": 0.5}
    cfg = learner_cfg(tmp_path, policy=str(policy), kl_coef=0.1, override_config=changed, adv_estimator="gae")
    cfg.critic.override_config = {"rms_norm_eps": 0.25}
    trainer = Trainer(cfg)
    assert trainer.model.config.rms_norm_eps == 0.5 and trainer.reference.config.rms_norm_eps == 0.5
    assert trainer.critic.model.config.rms_norm_eps == 0.25
    plain = Trainer(learner_cfg(tmp_path, policy=str(policy)))
    assert plain.model.config.rms_norm_eps == model.config.rms_norm_eps
    samples = batch(1)
    ours, theirs = trainer.logprobs(samples), plain.logprobs(samples)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) > 1e-3  # the config is what computes
    engine = TransformersBackend(str(policy), overrides=changed)
    assert engine.model.config.rms_norm_eps == 0.5
    with torch.no_grad():  # the sampler's model is the learner's, value for value
        ids = torch.tensor([list(samples[0].prompt_ids) + list(samples[0].response_ids)])
        torch.testing.assert_close(engine.model(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    with pytest.raises(ConfigError, match="learner.override_config.no_such"):
        Trainer(learner_cfg(tmp_path, policy=str(policy), override_config={"no_such": {"x": 1}}))
    # the memory estimate counts the model the learner loads (a wider MLP: more parameters)
    from streamrl.learner.distributed import count_parameters

    assert count_parameters(str(policy), overrides={"intermediate_size": 256}) > count_parameters(str(policy))


def test_critic_warmup_trains_the_critic_alone_for_verls_steps(tmp_path):
    """``critic_warmup`` 3: the updates towards versions 1 and 2 (verl's steps 1 and 2, below 3)
    leave the policy as it was and train the critic; version 3's trains both, at the lr of the
    policy's first update (verl's actor scheduler steps only with the actor)."""
    from streamrl.learner.metrics import observe_update

    cfg = learner_cfg(tmp_path, adv_estimator="gae", critic_warmup=3, versions=6, lr_scheduler_type="cosine")
    trainer = Trainer(cfg)
    first = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    critic_before = {k: p.detach().clone() for k, p in trainer.critic.model.named_parameters()}
    for version in (0, 1):
        trainer.set_version(version)
        out = trainer.step(batch(version))
        assert out["critic_warmup"] == 1.0 and out["critic/vf_loss"] > 0
        # the learner stage's gauges take an update without policy figures (it raised KeyError 'ppo_kl')
        observe_update(out, len(batch(version)))
        assert "ppo_kl" not in out
        for k, p in trainer.model.named_parameters():
            assert torch.equal(p, first[k]), (version, k)
    assert any(not torch.equal(p, critic_before[k]) for k, p in trainer.critic.model.named_parameters())
    trainer.set_version(2)
    out = trainer.step(batch(2))
    assert out["critic_warmup"] == 0.0 and out["lr"] == pytest.approx(lr_at(cfg, 0, 6))
    assert any(not torch.equal(p, first[k]) for k, p in trainer.model.named_parameters())
    trainer.set_version(3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(cfg, 1, 6))
    with pytest.raises(ConfigError, match="learner.critic_warmup"):
        learner_cfg(tmp_path, critic_warmup=-1)
    # without a critic (GRPO), as verl's: the steps below the warm-up update nothing
    grpo = Trainer(learner_cfg(tmp_path, critic_warmup=2))
    first = {k: p.detach().clone() for k, p in grpo.model.named_parameters()}
    grpo.set_version(0)
    assert grpo.step(batch(0))["critic_warmup"] == 1.0
    assert all(torch.equal(p, first[k]) for k, p in grpo.model.named_parameters())
    grpo.set_version(1)
    assert grpo.step(batch(1))["critic_warmup"] == 0.0
    assert any(not torch.equal(p, first[k]) for k, p in grpo.model.named_parameters())
