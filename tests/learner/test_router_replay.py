"""MoE router replay on a tiny Qwen2-MoE built on CPU (``streamrl.routing``): the rollout records
the experts each token was routed to, the record carries them, and the learner's forward passes
replay them (R3) or replay its own old-log-prob pass's (R2). Measured: with replay the learner
routes exactly as the rollout did, and the log-prob mismatch between the two falls."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from streamrl.bench.routing import mismatch
from streamrl.learner.samples import to_samples
from streamrl.learner.trainer import Trainer
from streamrl.records import RecordError, Rewarded
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.routing import RouterTap, find_routers, pack
from tests.helpers import learner_cfg, tiny_moe

PROMPTS = ["The cat sat on", "Two plus two is", "Once upon a time", "Kafka topics hold",
           "Experts route tokens", "A tiny model says", "Replay the router", "Sampling at one"]


def rollout(policy: str, dtype: str = "float32", n: int = 2, tokens: int = 16, prompts: int = 8) -> list:
    engine = TransformersBackend(policy, dtype=dtype, seed=0, return_routed_experts=True)
    groups = asyncio.run(engine.generate(PROMPTS[:prompts], n, SamplingParams(max_new_tokens=tokens, temperature=1.0,
                                                                              ignore_eos=True)))
    return [s for g in groups for s in g]


def records(completions) -> list[Rewarded]:
    """The completions as rewarded records, through the codec (bytes and back)."""
    out = []
    for i, c in enumerate(completions):
        routes, shape = pack(c.routed_experts)
        rec = Rewarded(id=f"r{i}", group_id=f"g{i // 2}", group_size=2, policy_version=0, data_source="t",
                       prompt="p", response=c.text, prompt_ids=np.asarray(c.prompt_ids, np.int32),
                       response_ids=np.asarray(c.response_ids, np.int32), response_logprobs=c.response_logprobs,
                       routed_experts=routes, routed_experts_shape=shape, reward=float(i % 2), reward_info={},
                       scorer={"name": "t", "version": "1"})
        out.append(Rewarded.decode(rec.encode()))
    return out


class Chosen:
    """The experts the policy's routers actually used in each pass (a hook after the tap's)."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.handles = [m.register_forward_hook(self._hook(layer)) for layer, m in find_routers(model)]

    def _hook(self, layer):
        def hook(module, args, output):
            self.calls.setdefault(layer, []).append(output[2].detach().clone())
        return hook

    def take(self) -> dict[int, list[torch.Tensor]]:
        calls, self.calls = self.calls, {}
        return calls


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return tiny_moe(root / "learner"), tiny_moe(root / "rollout", noise=0.03)


@pytest.fixture(scope="module")
def r3(policies, tmp_path_factory):
    """The learner's trainer on the learner's weights, replaying the rollout's routing (R3)."""
    cfg = learner_cfg(tmp_path_factory.mktemp("r3"), policy=policies[0], router_replay="R3")
    return cfg, Trainer(cfg)


@pytest.mark.parametrize("case", ["perturbed", "bf16"])
def test_replay_routes_as_the_rollout_did_and_the_logprob_mismatch_falls(policies, r3, case):
    learner, perturbed = policies
    # (bf16 on CPU is slow: fewer samples)
    completions = rollout(perturbed) if case == "perturbed" else rollout(learner, dtype="bfloat16", n=1, prompts=6)
    for c in completions:  # a row per token fed: the prompt's and every response token but the last
        assert c.routed_experts.shape == (len(c.prompt_ids) + len(c.response_ids) - 1, 2, 2)
    cfg, trainer = r3
    samples = to_samples(records(completions), cfg, trainer)
    native_lp, native_routes, rows = mismatch(trainer, samples, replay=False)
    replay_lp, replay_routes, _ = mismatch(trainer, samples, replay=True)
    print(f"router replay ({case}): {rows} (token, layer) rows; routing differs on {native_routes:.1%} without "
          f"replay, {replay_routes:.1%} with; mean |logprob diff| {native_lp:.4f} without, {replay_lp:.4f} with")
    assert replay_routes == 0.0  # the learner routes exactly as the rollout did
    assert native_routes > 0.0  # (the weights differ enough that, by itself, it does not)
    assert replay_lp < native_lp


def test_r2_replays_the_old_logprob_pass_routing_in_every_update_pass(policies, tmp_path):
    learner, _ = policies
    cfg = learner_cfg(tmp_path, policy=learner, router_replay="R2", ppo_epochs=3, lr=0.05, micro_batch_size=4)
    trainer = Trainer(cfg)
    samples = to_samples(records(rollout(learner, n=2, tokens=8)[:4]), cfg, trainer)
    chosen = Chosen(trainer.model)
    trainer.step(samples)
    calls = chosen.take()
    passes = {layer: len(c) for layer, c in calls.items()}
    assert set(passes.values()) == {1 + 3}  # the recording pass, then one pass per epoch
    for recorded, *updates in calls.values():
        for u in updates:
            assert torch.equal(u, recorded)
    # ... where the updated weights route some tokens elsewhere by themselves
    with torch.no_grad(), RouterTap(trainer.model).recording() as now:
        batch = trainer._collate(sorted(samples, key=lambda s: s.id))
        trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert any(not torch.equal(now[layer][0], calls[layer][0]) for layer in calls)


def test_a_record_whose_routing_does_not_fit_is_refused_by_name(policies, r3):
    learner, _ = policies
    cfg, trainer = r3
    (good,) = records(rollout(learner, n=1, tokens=4)[:1])
    routes = good.array("routed_experts").reshape(good.routed_experts_shape)
    cases = {
        "too many rows": pack(np.concatenate([routes, routes[:2]])),
        "other layers": pack(np.concatenate([routes, routes], axis=1)),
        "an expert the model lacks": pack(np.where(routes == 0, 9, routes)),
    }
    for what, (flat, shape) in cases.items():
        bad = dataclasses.replace(good, routed_experts=flat, routed_experts_shape=shape)
        with pytest.raises(RecordError) as err:
            to_samples([Rewarded.decode(bad.encode())], cfg, trainer)
        assert err.value.reason == "bad_routing", what
    bad = dataclasses.replace(good, routed_experts_shape=[1, 2, 2])
    with pytest.raises(RecordError, match="bad_routing|routed_experts"):
        to_samples([Rewarded.decode(bad.encode())], cfg, trainer)
    # a record without routing trains, routed by the learner itself
    (plain,) = to_samples([dataclasses.replace(good, routed_experts=None, routed_experts_shape=None)], cfg, trainer)
    assert plain.routed_experts is None


def test_a_dense_policy_is_refused_for_router_replay(tmp_path):
    from streamrl.errors import ConfigError

    with pytest.raises(ConfigError, match="learner.router_replay"):
        Trainer(learner_cfg(tmp_path, router_replay="R3"))
    with pytest.raises(ConfigError, match="rollout.return_routed_experts"):
        TransformersBackend("tiny", return_routed_experts=True)


@pytest.mark.parametrize("server_format", ["vllm", "sglang"])
def test_the_openai_backend_reads_the_servers_routed_experts(policies, server_format):
    """A real ``/v1/completions`` server in the test process returns the routing as vLLM
    (each choice's base64 ``.npy``) or SGLang (``sglext``: base64 flat int32) does; the backend
    sends one request per sample and each completion carries the server's routing."""
    from streamrl.rollout.backends.openai_server import OpenAIBackend
    from tests.rollout.completions_server import CompletionsServer, start_server

    learner, _ = policies

    async def go():
        engine = TransformersBackend(learner, seed=0, return_routed_experts=True)
        server = CompletionsServer(engine, routed_format=server_format)
        runner, url = await start_server(server)
        backend = OpenAIBackend(url, "m", return_routed_experts=True, route_shape=(2, 2))
        try:
            groups = await backend.generate([[5, 6, 7], [8, 9]], 2, SamplingParams(max_new_tokens=5, ignore_eos=True))
        finally:
            await backend.close()
            await runner.cleanup()
        return server, groups

    server, groups = asyncio.run(go())
    assert [b["n"] for b in server.requests] == [1] * 4 and not any(b.get("stream") for b in server.requests)
    assert all(b["return_routed_experts"] for b in server.requests)
    for group in groups:
        for c in group:
            assert c.routed_experts.shape == (len(c.prompt_ids) + len(c.response_ids) - 1, 2, 2)
            assert c.routed_experts.max() < 8


def test_the_record_packs_routing_in_its_narrowest_dtype_and_checks_it():
    import base64
    import io

    from streamrl.records import Trajectory
    from streamrl.routing import RoutingError, from_sglang, from_vllm, unpack

    base = dict(group_id="g", group_size=1, policy_version=0, data_source="t", prompt="p", response="r",
                prompt_ids=[1, 2], response_ids=[3])
    for experts, dtype in ((128, "uint8"), (256, "uint8"), (384, "uint16")):
        routes = np.random.default_rng(experts).integers(0, experts, (2, 3, 4))
        routes[0, 0, 0] = experts - 1
        flat, shape = pack(routes, experts)
        rec = Trajectory.decode(Trajectory(**base, routed_experts=flat, routed_experts_shape=shape).encode())
        assert rec.routed_experts["dtype"] == dtype and shape == [2, 3, 4]
        assert np.array_equal(unpack(rec.array("routed_experts"), rec.routed_experts_shape), routes)
    # a producer's plain list is packed at decode; a dtype other than uint8/uint16 is refused
    rec = Trajectory.from_dict({**Trajectory(**base).to_dict(), "routed_experts": [1, 2, 3, 4],
                                "routed_experts_shape": [1, 2, 2]})
    assert rec.array("routed_experts").tolist() == [1, 2, 3, 4]
    bad = {**Trajectory(**base).to_dict(), "routed_experts": {"dtype": "int32", "b64": "AAAAAA=="}}
    with pytest.raises(RecordError):
        Trajectory.from_dict(bad)
    with pytest.raises(RoutingError):
        pack(np.array([[[-1, 2]]]))
    # vLLM's .npy: an integer [tokens, layers, topk] array, never an object array (no unpickling)
    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.uint16).reshape(2, 3, 2))
    assert from_vllm(base64.b64encode(buf.getvalue()).decode()).shape == (2, 3, 2)
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(RoutingError):
        from_vllm(base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(RoutingError):
        from_vllm("not base64!")
    # SGLang's flat int32: whole rows of layers x top-k
    flat = base64.b64encode(np.arange(12, dtype="<i4").tobytes()).decode()
    assert from_sglang(flat, 3, 2).shape == (2, 3, 2)
    with pytest.raises(RoutingError):
        from_sglang(flat, 5, 2)


def test_replay_holds_through_the_recomputation_of_gradient_checkpointing(policies, tmp_path):
    """With activation checkpointing the backward recomputes each layer: its routers replay the
    same routing there, so the gradients are the ones without checkpointing."""
    from streamrl.errors import ConfigError

    learner, perturbed = policies
    norms = []
    for ckpt in (False, True):
        cfg = learner_cfg(tmp_path / str(ckpt), policy=learner, router_replay="R3", gradient_checkpointing=ckpt,
                          micro_batch_size=4)
        trainer = Trainer(cfg)
        samples = to_samples(records(rollout(perturbed, n=2, tokens=8, prompts=2)), cfg, trainer)
        norms.append(trainer.step(samples)["grad_norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5)
    with pytest.raises(ConfigError, match="learner.router_replay"):
        learner_cfg(tmp_path, router_replay="R2", gradient_checkpointing=True, max_tokens_per_micro_batch=256)


def test_a_multi_turn_record_carries_its_last_turns_routing_which_covers_every_earlier_token():
    """Each model turn's request holds the whole context, so the last turn's routing covers every
    token fed before its last one; the feedback after it (none here) would route by itself."""
    from streamrl.rollout.config import RolloutConfig
    from streamrl.records import Prompt
    from streamrl.rollout.backends.base import Completion
    from streamrl.rollout.episode_state import EpisodeState
    from streamrl.rollout.multiturn import MultiTurn
    from streamrl.rollout.trajectory import build_trajectory

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [9] * len(text.split())}

    rng = np.random.default_rng(0)
    e = EpisodeState(index=0, messages=[{"role": "user", "content": "q"}], context=[1, 2], prompt_ids=[1, 2],
                     token_level=True)
    e.add_sample(Completion(text="a", prompt_ids=[1, 2], response_ids=[5, 6, 7], response_logprobs=[-0.1] * 3,
                            finish_reason="stop", policy_version=0, routed_experts=rng.integers(0, 8, (4, 2, 2))))
    e.add_turn([({"role": "user", "content": "again"}, {"role": "user", "content": "again"})], "user: try again", Tok())
    last = rng.integers(0, 8, (2 + 3 + 3 + 4 - 1, 2, 2))  # its context (2 + 3 + 3 tokens) and its own 4, less one
    e.add_sample(Completion(text="b", prompt_ids=[1, 2, 5, 6, 7, 9, 9, 9], response_ids=[8, 8, 8, 8],
                            response_logprobs=[-0.2] * 4, finish_reason="stop", policy_version=0, routed_experts=last))
    t = build_trajectory(Prompt(group_id="g", group_size=1, data_source="t", prompt="q"), 1, e, 0.0,
                         MultiTurn.from_config(RolloutConfig()))
    assert t.routed_experts_shape == [11, 2, 2] and len(t.array("prompt_ids")) + len(t.array("response_ids")) == 12
    assert np.array_equal(t.array("routed_experts").reshape(11, 2, 2), last)


def test_the_tap_takes_softmax_top_k_routers_and_refuses_others_by_name():
    """Qwen3-MoE (renormalised top-k) and Mixtral replay; DeepSeek-V3's grouped sigmoid router,
    whose weights replay could not recompute, is refused naming its class."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from streamrl.routing import RoutingError

    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    for model in (Qwen3MoeForCausalLM(Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=8,
                                                     num_experts_per_tok=2, norm_topk_prob=True)),
                  MixtralForCausalLM(MixtralConfig(**small, num_local_experts=8, num_experts_per_tok=2))):
        tap = RouterTap(model)
        assert (tap.layers, tap.topk, tap.num_experts) == (2, 2, 8)
        ids = torch.randint(0, 300, (1, 6))
        with torch.no_grad(), tap.recording():
            model(input_ids=ids)
            native = tap.stacked()
        swapped = native.flip(-1).roll(1, dims=0)  # other experts, for every token but by chance
        with torch.no_grad():
            chosen = Chosen(model)
            with tap.replaying(swapped, torch.ones(6, dtype=torch.bool)):
                model(input_ids=ids)
            assert all(torch.equal(calls[0], swapped[:, layer]) for layer, calls in chosen.take().items())
    deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(
        **small, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8))
    with pytest.raises(RoutingError, match="DeepseekV3TopkRouter"):
        RouterTap(deepseek)
