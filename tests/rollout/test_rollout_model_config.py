"""verl's ``model.override_config`` on the rollout side: the policy servers streamrl launches
take it on their command line (vLLM's ``--hf-overrides``, SGLang's
``--json-model-override-args``), vLLM's engine in process as ``hf_overrides``. The servers here
are processes started by ``rollout.servers_launch``'s own machinery from ``vllm`` and
``sglang.launch_server`` stand-ins (``tests/rollout/flag_server.py``) that read the flags with
their real names and JSON grammar and build the model's config from them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from streamrl.pipeline_config import load_config
from streamrl.policy import load_policy
from streamrl.rollout.backends import engine_kwargs
from streamrl.rollout.worker import launch_servers
from streamrl.weights import save_policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """``vllm`` on PATH and an ``sglang`` package, both the flag server."""
    bin_dir, pkgs = tmp_path / "bin", tmp_path / "pkgs"
    (pkgs / "sglang").mkdir(parents=True)
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.rollout.flag_server vllm "$@"\n')
    vllm.chmod(0o755)
    (pkgs / "sglang" / "__init__.py").write_text("")
    (pkgs / "sglang" / "launch_server.py").write_text(
        "import sys\nsys.argv = [sys.argv[0], 'sglang', *sys.argv[1:]]\n"
        "from tests.rollout.flag_server import main\nmain()\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{pkgs}")
    monkeypatch.syspath_prepend(str(pkgs))  # (the start checks sglang is importable)
    model, tok = load_policy("tiny")
    return str(save_policy(model, tok, tmp_path / "policy"))


async def served(rollout) -> dict:
    servers = launch_servers(rollout)
    servers.specs["policy"].startup_timeout_s = 120
    await servers.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(servers.urls("policy")[0] + "/v1/models") as resp:
                return (await resp.json())["data"][0]
    finally:
        await servers.close()


def test_launched_servers_build_the_policy_with_verls_override_config(stand_ins):
    """SGLang's servers (verl's rollout.name=sglang) and vLLM's (servers_launch.backend=vllm),
    started together: each builds the policy's config with the overrides."""
    overrides = "actor_rollout_ref.model.override_config={max_position_embeddings: 4096, rms_norm_eps: 0.5}"
    given = [f"actor_rollout_ref.model.path={stand_ins}", overrides]
    configs = {"sglang": load_config(None, [*given, "actor_rollout_ref.rollout.name=sglang"]),
               "vllm": load_config(None, [*given, "rollout.backend=openai", "rollout.servers_launch.backend=vllm",
                                          "rollout.openai.model=policy"])}
    for cfg in configs.values():
        assert cfg.learner.override_config == cfg.rollout.override_config == {"max_position_embeddings": 4096,
                                                                            "rms_norm_eps": 0.5}

    async def both() -> list[dict]:
        return await asyncio.gather(*(served(cfg.rollout) for cfg in configs.values()))

    for engine, entry in zip(configs, asyncio.run(both())):
        assert entry["streamrl_flags"]["kind"] == engine
        assert entry["streamrl_flags"]["hf_overrides"] == {"max_position_embeddings": 4096, "rms_norm_eps": 0.5}
        assert entry["streamrl_config"]["max_position_embeddings"] == 4096
        assert entry["streamrl_config"]["rms_norm_eps"] == 0.5


def test_vllms_engine_takes_the_overrides_as_hf_overrides_and_none_adds_nothing():
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=vllm",
                             "+actor_rollout_ref.model.override_config.max_position_embeddings=4096",
                             "rollout.vllm.engine_kwargs={enable_prefix_caching: true}"])
    assert engine_kwargs(cfg.rollout) == {"enable_prefix_caching": True,
                                          "hf_overrides": {"max_position_embeddings": 4096}}
    plain = load_config(None, ["actor_rollout_ref.rollout.name=vllm"])
    assert engine_kwargs(plain.rollout) == {}
    assert json.loads(json.dumps(engine_kwargs(cfg.rollout)))  # (what crosses to vLLM's workers)
