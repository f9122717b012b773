"""verl's ``model.override_config`` and ``rollout.quantization`` on the rollout side: the policy
servers streamrl launches take them on their command line (vLLM's ``--hf-overrides``, SGLang's
``--json-model-override-args``, both's ``--quantization``), vLLM's engine in process as
``hf_overrides`` and ``quantization``. The servers here
are processes started by ``rollout.servers_launch``'s own machinery from ``vllm`` and
``sglang.launch_server`` stand-ins (``tests/rollout/flag_server.py``) that read the flags with
their real names and JSON grammar and build the model's config from them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from streamrl.errors import ConfigError
from streamrl.pipeline_config import load_config, resolve_config
from streamrl.policy import load_policy
from streamrl.rollout.backends import engine_kwargs
from streamrl.rollout.worker import launch_servers
from streamrl.servers.processes import ServerConfig, server_argv, validate_servers
from streamrl.supervisor.plan import rollout_notes
from streamrl.weights import save_policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """``vllm`` and ``trtllm-serve`` on PATH and an ``sglang`` package, all the flag server."""
    bin_dir, pkgs = tmp_path / "bin", tmp_path / "pkgs"
    (pkgs / "sglang").mkdir(parents=True)
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.rollout.flag_server vllm "$@"\n')
    vllm.chmod(0o755)
    trtllm = bin_dir / "trtllm-serve"
    trtllm.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.rollout.flag_server trtllm "$@"\n')
    trtllm.chmod(0o755)
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


def test_launched_servers_build_the_policy_with_verls_override_config_and_quantization(stand_ins, tmp_path):
    """SGLang's servers (verl's rollout.name=sglang) and vLLM's (servers_launch.backend=vllm),
    started together: each builds the policy's config with the overrides, and quantises as verl's
    rollout.quantization says (--quantization; vLLM's config file inside --hf-overrides, where
    vLLM reads it). The weights they load stay the published ones (the same model path)."""
    overrides = "actor_rollout_ref.model.override_config={max_position_embeddings: 4096, rms_norm_eps: 0.5}"
    quant_file = tmp_path / "torchao.json"
    quant_file.write_text("{}")
    given = [f"actor_rollout_ref.model.path={stand_ins}", overrides]
    configs = {"sglang": load_config(None, [*given, "actor_rollout_ref.rollout.name=sglang",
                                            "actor_rollout_ref.rollout.quantization=fp8"]),
               "vllm": load_config(None, [*given, "rollout.backend=openai", "rollout.servers_launch.backend=vllm",
                                          "rollout.openai.model=policy", "actor_rollout_ref.rollout.quantization=torchao",
                                          f"actor_rollout_ref.rollout.quantization_config_file={quant_file}"])}
    for cfg in configs.values():
        assert cfg.learner.override_config == cfg.rollout.override_config == {"max_position_embeddings": 4096,
                                                                            "rms_norm_eps": 0.5}

    async def both() -> list[dict]:
        return await asyncio.gather(*(served(cfg.rollout) for cfg in configs.values()))

    for engine, entry in zip(configs, asyncio.run(both())):
        flags = entry["streamrl_flags"]
        assert flags["kind"] == engine and flags["model"] == stand_ins
        assert flags["quantization"] == {"sglang": "fp8", "vllm": "torchao"}[engine]
        extra = {"quantization_config_file": str(quant_file)} if engine == "vllm" else {}
        assert flags["hf_overrides"] == {"max_position_embeddings": 4096, "rms_norm_eps": 0.5, **extra}
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


def test_vllms_engine_takes_the_quantization_and_its_file():
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization=fp8",
                             "actor_rollout_ref.rollout.quantization_config_file=q.json",
                             "+actor_rollout_ref.model.override_config.max_position_embeddings=4096"])
    assert engine_kwargs(cfg.rollout) == {"quantization": "fp8", "hf_overrides": {
        "max_position_embeddings": 4096, "quantization_config_file": "q.json"}}
    # verl's null: none; a file without a quantization is not read (as verl)
    plain = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization=null",
                               "actor_rollout_ref.rollout.quantization_config_file=q.json"])
    assert (plain.rollout.quantization, plain.rollout.quantization_config_file) == ("", "")
    assert engine_kwargs(plain.rollout) == {}


@pytest.mark.parametrize("overrides, field", [
    (["actor_rollout_ref.rollout.quantization=fp8"], "'rollout.quantization'"),  # verl's keys, no engine: transformers
    (["rollout.quantization=fp8"], "'rollout.quantization'"),
    (["rollout.backend=openai", "rollout.openai.model=m", "rollout.quantization=fp8"], "'rollout.quantization'"),
    (["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.model.path=m",
      "actor_rollout_ref.rollout.quantization=fp8", "rollout.quantization_config_file=q.json"],
     "'rollout.quantization_config_file'"),
    (["rollout.backend=vllm", "rollout.quantization_config_file=q.json"], "'rollout.quantization_config_file'"),
])
def test_a_rollout_that_cannot_quantise_is_refused_naming_the_key(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides).rollout.validate()


def test_verls_hf_rollout_refuses_quantization_naming_the_key():
    r = resolve_config(None, ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.quantization=fp8"])
    assert any(p.startswith("actor_rollout_ref.rollout.quantization=fp8: refused") for p in r.problems), r.problems


def test_the_dry_run_says_the_mismatch_is_what_rollout_correction_is_for(tmp_path):
    base = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization=fp8"]
    [note] = rollout_notes(load_config(None, base))
    assert "rollout/learner mismatch" in note and "rollout_correction" in note and note.endswith("it is off")
    corrected = load_config(None, [*base, "algorithm.rollout_correction.rollout_is=token"])
    assert corrected.learner.rollout_correction.enabled and rollout_notes(corrected) == []
    assert rollout_notes(load_config(None, ["actor_rollout_ref.rollout.name=vllm"])) == []
    proc = subprocess.run([sys.executable, "-m", "streamrl", "run", "--dry-run", *base], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "# rollout.quantization fp8: " in proc.stdout and "quantization: fp8" in proc.stdout


def test_trtllm_servers_serve_a_fixed_policy_and_never_one_that_must_follow_the_learner(stand_ins):
    """rollout.servers_launch.backend=trtllm launches trtllm-serve (its real flags: MODEL
    positional, --tp_size, the PyTorch backend) for a policy that follows no learner; trtllm-serve
    takes no weight updates, so a rollout that follows the learner (verl's rollout.name=trtllm in a
    training run) is refused naming the key, never sampled from the starting weights in silence."""
    base = [f"rollout.policy={stand_ins}", "rollout.backend=openai", "rollout.openai.model=policy",
            "rollout.servers_launch.backend=trtllm", "rollout.servers_launch.gpus_per_replica=2"]
    cfg = load_config(None, [*base, "rollout.follow_policy=false"])
    assert cfg.rollout.resolved_update_api() == "none"
    entry = asyncio.run(served(cfg.rollout))
    flags = entry["streamrl_flags"]
    assert (flags["kind"], flags["model"], flags["tensor_parallel_size"], flags["backend"]) == \
        ("trtllm", stand_ins, 2, "pytorch")
    for bad in ([*base], [*base, "rollout.follow_policy=false", "rollout.openai.update_api=vllm"]):
        with pytest.raises(ConfigError, match="'rollout.servers_launch.backend': trtllm-serve takes no weight"):
            load_config(None, bad).rollout.validate()
    with pytest.raises(ConfigError, match="'rollout.quantization': trtllm-serve"):
        load_config(None, [*base, "rollout.follow_policy=false", "rollout.quantization=fp8"]).rollout.validate()
    # a generative reward model on trtllm-serve (its weights never change); a classifier is not served by it
    judge = ServerConfig(name="judge", model="m", backend="trtllm", task="generate", port=8100)
    assert server_argv(judge, 8100)[1:] == ["m", "--host", "127.0.0.1", "--port", "8100", "--tp_size", "1",
                                            "--backend", "pytorch"]
    with pytest.raises(ConfigError, match=r"reward.servers\[0\].task'"):
        validate_servers([ServerConfig(name="rm", model="m", backend="trtllm")])
    r = resolve_config(None, ["actor_rollout_ref.rollout.name=trtllm"])
    [problem] = [p for p in r.problems if "rollout.name" in p]
    assert problem.startswith("actor_rollout_ref.rollout.name=trtllm: refused") and "trtllm-serve takes no" in problem
