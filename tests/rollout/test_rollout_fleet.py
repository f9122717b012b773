"""Rollouts on a fleet of inference servers that follows the learner (``streamrl.rollout.fleet``).

The servers are real aiohttp servers in the test process speaking the OpenAI completions API
(token ids and log-probs, as vLLM does) and the weight-update endpoints (SGLang's
``/update_weights_from_disk``, vLLM's dev-mode ``/collective_rpc`` + ``/reset_prefix_cache``).
Each answers with the version it had loaded when the request started and when it ended
(``"v3-v3"``), so a test sees which weights answered and whether they changed under a request.
``streamrl run`` runs the whole pipeline on two servers (on the test's broker, so its records can
be read afterwards); the drain / abort tests run the rollout stage on the in-memory bus
(``memory_bus`` fixture) with the test playing the learner, so that versions arrive while
requests are in flight.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from streamrl import metrics
from streamrl.bus import Bus
from streamrl.errors import ConfigError
from streamrl.records import DeadLetter, PolicyVersion, Prompt, Trajectory
from streamrl.rollout.backends import SamplingParams, WeightLoadError
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.config import OpenAIBackendConfig, RolloutConfig, ServersLaunchConfig
from streamrl.rollout.worker import RolloutWorker
from streamrl.servers.processes import ServerConfig, ServerProcesses, server_argv
from tests.helpers import AppServer, last_json_line, read_topic
from tests.rollout.streaming import reply


class PolicyServer(AppServer):
    """A policy server whose weights are a version number: ``latency`` per completion,
    ``load_s`` per weight load; ``fail_updates`` answers the next loads with 500,
    ``hang_updates`` never answers them; ``dead`` fails everything, health included."""

    def __init__(self, latency: float = 0.05, load_s: float = 0.05):
        self.latency, self.load_s = latency, load_s
        self.version = 0
        self.fail_updates = self.hang_updates = 0
        self.dead = False
        self.completions = 0  # requests answered
        self.updates: list[tuple[str, object]] = []  # (route, body)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/update_weights_from_disk", self._sglang)
        app.router.add_post("/collective_rpc", self._vllm)
        app.router.add_post("/reset_prefix_cache", self._reset)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.dead:
            return web.json_response({"error": "down"}, status=503)
        started = self.version
        await asyncio.sleep(self.latency)
        self.completions += 1
        text = f"v{started}-v{self.version}"
        choices = [{"index": i, "text": text, "finish_reason": "stop", "token_ids": [5, 6, 7],
                    "prompt_token_ids": [1, 2, 3], "logprobs": {"tokens": ["a", "b", "c"],
                                                                 "token_logprobs": [-0.5, -0.25, -1.0]}}
                   for i in range(body.get("n", 1))]
        return await reply(request, body, choices)

    async def _load(self, route: str, body: object, path: str) -> web.Response:
        self.updates.append((route, body))
        if self.hang_updates:
            self.hang_updates -= 1
            await asyncio.sleep(2.0)  # past the update timeout
        if self.fail_updates:
            self.fail_updates -= 1
            return web.json_response({"error": "out of memory"}, status=500)
        await asyncio.sleep(self.load_s)
        self.version = int(re.search(r"v(\d+)$", path).group(1))
        return web.json_response({"success": True, "message": "ok"})

    async def _sglang(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._load("/update_weights_from_disk", body, body["model_path"])

    async def _vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._load("/collective_rpc", body, body["args"][0])

    async def _reset(self, request: web.Request) -> web.Response:
        self.updates.append(("/reset_prefix_cache", None))
        return web.json_response({})


def announced_before(announced: dict[int, float], t: float) -> int:
    return max((v for v, at in announced.items() if at <= t), default=0)


@pytest.mark.parametrize("on_update", ["drain", "abort"])
def test_records_carry_the_version_their_server_had_and_nothing_is_lost(memory_bus, tmp_path, on_update):
    bus = memory_bus  # the worker's and the fleet's logic; the servers are real HTTP
    per_version, groups = 4, 12
    # max_staleness 2: the gate leaves room beyond the 4 prompts in flight, so versions arrive
    # while requests run (the case drain and abort are about)
    cfg = RolloutConfig(backend="openai", group_size=2, max_in_flight=4, max_staleness=2,
                        trajectories_per_version=per_version, gate_poll_s=0.1, on_update=on_update,
                        openai=OpenAIBackendConfig(model="policy", api_key_env="", update_api="sglang",
                                                   max_retries=2, health_interval_s=0.5))
    prompts = [Prompt(group_id=f"g{i}", group_size=2, data_source="gsm8k", prompt=f"{i} + 1 =",
                      ground_truth=str(i + 1)) for i in range(groups)]
    aborted_before = metrics.ROLLOUT_REQUESTS_ABORTED._value.get()

    async def go():
        servers = [await PolicyServer(latency=0.3, load_s=0.1).start(), await PolicyServer(latency=0.3).start()]
        worker = RolloutWorker(bus, RolloutConfig(**{**cfg.__dict__, "servers": [s.url + "/v1" for s in servers]}))
        producer = bus.producer("learner")
        await producer.start()
        announced = {0: time.time()}
        await producer.send_and_wait(PolicyVersion(version=0, weights_uri=None))
        task = asyncio.create_task(worker.run())
        try:
            for p in prompts:
                await producer.send_and_wait(p)
            version, seen = 0, 0
            deadline = time.monotonic() + 60
            while seen < 2 * groups and time.monotonic() < deadline:  # the learner: a version per 4
                seen = len(await read_topic(bus, "rollouts", 2 * groups, timeout_s=0.3))
                if seen >= (version + 1) * per_version:
                    version += 1
                    announced[version] = time.time()
                    await producer.send_and_wait(PolicyVersion(
                        version=version, weights_uri=str(tmp_path / f"v{version}"), trained_records=seen))
            records = [Trajectory.decode(m.value) for m in await read_topic(bus, "rollouts", 2 * groups, 5)]
        finally:
            await producer.stop()
            worker.stop()
            await task
            for s in servers:
                await s.stop()
        return records, announced, servers

    records, announced, servers = asyncio.run(go())
    # nothing lost, nothing twice
    assert sorted(r.id for r in records) == sorted(f"g{i}-{k}" for i in range(groups) for k in range(2))
    for r in records:
        started, ended = map(int, re.fullmatch(r"v(\d+)-v(\d+)", r.response).groups())
        assert started == ended == r.policy_version, (r.id, r.response, r.policy_version)  # true versions
        assert r.policy_version <= announced_before(announced, r.created_at)
        # a new request goes to a server on the learner's latest version (as the worker knew it:
        # announced 2 s before), as a local engine would load it first
        assert r.policy_version >= announced_before(announced, r.timings["generation_started_at"] - 2.0)
    versions = [r.policy_version for r in sorted(records, key=lambda r: r.created_at)]
    assert len(set(versions)) >= 3 and versions[-1] >= 2  # the servers followed the learner
    assert all(s.completions > 0 and s.version >= 2 for s in servers)
    if on_update == "drain":  # nothing is ever cut short (abort: see the test below)
        assert metrics.ROLLOUT_REQUESTS_ABORTED._value.get() == aborted_before


@pytest.mark.parametrize("on_update", ["drain", "abort"])
def test_an_update_mid_request_drains_or_aborts_and_resubmits(tmp_path, on_update):
    """One server, one long request, a new version announced while it runs: drain answers it on
    the old weights (stamped 0) and loads after; abort cuts it, loads, and resubmits it (stamped
    1). Either way the record says the weights that answered it, and it is not lost."""
    async def go():
        server = await PolicyServer(latency=1.0).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="sglang", on_update=on_update,
                                health_interval_s=0)
        before = metrics.ROLLOUT_REQUESTS_ABORTED._value.get()
        try:
            await backend.use_starting_weights(0)
            request = asyncio.create_task(backend.generate(["1 + 1 ="], 2, SamplingParams()))
            await asyncio.sleep(0.3)  # in flight now
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await request
            while server.version != 1:
                await asyncio.sleep(0.05)
            return group, server.completions, metrics.ROLLOUT_REQUESTS_ABORTED._value.get() - before
        finally:
            await backend.close()
            await server.stop()

    group, answered, aborted = asyncio.run(go())
    expected = 0 if on_update == "drain" else 1
    assert len(group) == 2 and all(s.policy_version == expected and s.text == f"v{expected}-v{expected}"
                                   for s in group)
    assert aborted == (2 if on_update == "abort" else 0)  # each sample its own (streamed) request


def test_a_server_failing_its_update_is_out_retried_and_rejoins(tmp_path):
    async def go():
        good, bad = await PolicyServer(latency=0.02).start(), await PolicyServer(latency=0.02).start()
        bad.fail_updates, bad.hang_updates = 2, 1  # HTTP 500 twice, then a load that never answers
        backend = OpenAIBackend("", "policy", servers=[good.url, bad.url], update_api="sglang",
                                update_timeout_s=0.5, update_retry_s=0.1, update_retry_max_s=0.2,
                                health_interval_s=0)
        fails = lambda: metrics.ROLLOUT_SERVER_UPDATE_FAILURES.labels(bad.url)._value.get()  # noqa: E731
        before = fails()
        try:
            await backend.load_weights(str(tmp_path / "v1"), 1)
            out_seen = False
            while backend.fleet.members[bad.url].version != 1:
                out_seen |= bad.url in backend.fleet.out and "update failed" in backend.fleet.status()
                (group,) = await backend.generate(["1 + 1 ="], 2, SamplingParams())
                assert all(s.policy_version == 1 and s.text == "v1-v1" for s in group)  # only the good one
                await asyncio.sleep(0.02)
            answered = bad.completions
            await asyncio.gather(*(backend.generate(["x"], 1, SamplingParams()) for _ in range(20)))
            return out_seen, fails() - before, bad.completions - answered, metrics.ROLLOUT_SERVERS_OUT._value.get()
        finally:
            await backend.close()
            await good.stop()
            await bad.stop()

    out_seen, failures, after, out_now = asyncio.run(go())
    assert out_seen and failures == 3  # 500, 500, timeout
    assert after > 0 and out_now == 0  # back in rotation, on the new version


def test_router_sends_fewer_requests_to_a_slow_server_and_none_to_a_dead_one():
    async def go():
        fast, slow = await PolicyServer(latency=0.02).start(), await PolicyServer(latency=0.4).start()
        backend = OpenAIBackend("", "policy", servers=[fast.url, slow.url], update_api="sglang",
                                health_interval_s=0.2, eject_after=2, max_retries=3)
        try:
            await backend.use_starting_weights(0)
            async def client() -> None:  # 4 clients, one request at a time each
                for i in range(10):
                    await backend.generate([f"{i}"], 1, SamplingParams())

            await asyncio.gather(*(client() for _ in range(4)))
            split = (fast.completions, slow.completions)
            slow.dead = True
            while slow.url not in backend.fleet.router.ejected:
                await backend.generate(["x"], 1, SamplingParams())
                await asyncio.sleep(0.05)
            slow.completions = 0
            calls = len(slow.updates)
            await asyncio.gather(*(backend.generate([f"{i}"], 1, SamplingParams()) for i in range(20)))
            return split, slow.completions, calls
        finally:
            await backend.close()
            await fast.stop()
            await slow.stop()

    (fast, slow), after_ejection, _ = asyncio.run(go())
    assert fast > 3 * slow and slow >= 1
    assert after_ejection == 0


def test_vllm_servers_load_through_collective_rpc_then_reset_the_prefix_cache(tmp_path):
    async def go():
        server = await PolicyServer().start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="vllm",
                                health_interval_s=0)
        try:
            await backend.load_weights(f"file://{tmp_path}/v3", 3)
            (group,) = await backend.generate(["hi"], 1, SamplingParams())  # waits for the load
            return server.updates, group[0]
        finally:
            await backend.close()
            await server.stop()

    updates, sample = asyncio.run(go())
    with pytest.raises(WeightLoadError, match="volume the servers mount"):  # they cannot fetch s3://
        asyncio.run(OpenAIBackend("", "policy", servers=["http://x:1"], update_api="vllm").load_weights(
            "s3://bucket/run/v4", 4))
    assert updates == [("/collective_rpc", {"method": "streamrl_load_weights", "args": [f"{tmp_path}/v3"]}),
                       ("/reset_prefix_cache", None)]
    assert sample.policy_version == 3 and sample.text == "v3-v3"


def test_servers_launch_builds_vllm_and_sglang_policy_servers(bus_config):
    vllm = ServerConfig(name="policy", model="Qwen/Qwen2.5-0.5B", backend="vllm", gpus_per_replica=2)
    argv = server_argv(vllm, 8001, role="policy")
    assert argv[1:3] == ["serve", "Qwen/Qwen2.5-0.5B"] and "--runner" not in argv
    assert argv[argv.index("--worker-extension-cls") + 1] == "streamrl.rollout.vllm_extension.WeightFollowerExtension"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    fleet = ServerProcesses([ServerConfig(name="policy", model="m", backend="vllm", replicas=2, port=9100)],
                          role="policy", field_name="rollout.servers_launch")
    assert fleet.urls("policy") == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert all(r.env["VLLM_SERVER_DEV_MODE"] == "1" for r in fleet.all_replicas())
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in fleet.all_replicas()] == ["0", "1"]
    sglang = server_argv(ServerConfig(name="policy", model="m", backend="sglang"), 30000, role="policy")
    assert sglang[1:3] == ["-m", "sglang.launch_server"] and "--is-embedding" not in sglang
    # the worker puts the launched servers into its fleet
    cfg = RolloutConfig(backend="openai", openai=OpenAIBackendConfig(model="m"), policy="m",
                        servers_launch=ServersLaunchConfig(backend="sglang", replicas=2, port=9200))

    async def build() -> RolloutWorker:
        worker = RolloutWorker(Bus(bus_config), cfg)
        for part in (worker.gate, worker.follower, worker.producer):  # built, never started
            await part.stop()
        return worker

    worker = asyncio.run(build())
    assert worker.backend.fleet.urls == ["http://127.0.0.1:9200", "http://127.0.0.1:9201"]
    assert worker.backend.can_load_weights and worker.backend.fleet.update_api == "sglang"
    with pytest.raises(ConfigError, match="rollout.on_update"):
        RolloutConfig(backend="openai", openai=OpenAIBackendConfig(model="m"), on_update="later").validate()
    with pytest.raises(ConfigError, match="rollout.servers_launch.backend"):
        RolloutConfig(servers_launch=ServersLaunchConfig(backend="sglang")).validate()


@pytest.mark.e2e
def test_streamrl_run_on_two_servers_that_follow_the_learner(bootstrap, bus_config, tmp_path):
    """The whole pipeline (``streamrl run``: feed, rollout, reward, learner as processes) on two
    policy servers, on the test's broker so the records can be read afterwards."""
    root = Path(__file__).resolve().parents[2]

    async def go():
        servers = [await PolicyServer(latency=0.05).start(), await PolicyServer(latency=0.1).start()]
        urls = ",".join(s.url for s in servers)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "streamrl", "run", "configs/local.yaml", "--bootstrap-servers", bootstrap,
            f"run.out_dir={tmp_path}", "run.reward_members=1", "feed.limit=40", "learner.versions=3",
            f"bus.topic_prefix={bus_config.topic_prefix}", "rollout.backend=openai", f"rollout.servers=[{urls}]",
            "rollout.openai.model=policy", "rollout.openai.update_api=sglang", "rollout.max_in_flight=8",
            cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 300)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for s in servers:
                await s.stop()
        bus = Bus(bus_config)
        records = [Trajectory.decode(m.value) for m in await read_topic(bus, "rollouts")]
        policy = [PolicyVersion.decode(m.value) for m in await read_topic(bus, "policy")]
        letters = [DeadLetter.decode(m.value) for m in await read_topic(bus, "deadletter")]
        return proc.returncode, out.decode(), err.decode(), records, policy, letters, servers

    code, out, err, records, policy, letters, servers = asyncio.run(go())
    assert code == 0, err[-3000:]
    summary = last_json_line(out)
    assert summary["ended"] in ("done", "data_exhausted") and summary["versions"] == 3
    assert [p.version for p in policy][-1] == 3  # the learner's versions advanced
    assert records
    for r in records:  # each record: the version its server had, unchanged while it answered
        started, ended = map(int, re.fullmatch(r"v(\d+)-v(\d+)", r.response).groups())
        assert started == ended == r.policy_version, (r.response, r.policy_version)
    versions = {r.policy_version for r in records}
    assert len(versions) >= 2 and all(s.version >= 1 and s.completions > 0 for s in servers)
    # the staleness bound on the rollout side: every request ran on the learner's latest version
    # as the worker knew it (announced 2 s before the generation started). (The learner may still
    # drop a group as stale: the reward stage finishes groups out of order, as with any backend.)
    announced = {p.version: p.created_at for p in policy}
    for r in records:
        assert r.policy_version >= announced_before(announced, r.timings["generation_started_at"] - 2.0)
    assert all(d.reason != "backend_error" for d in letters)
    # version 0 (the warm start) was loaded too, not taken from the servers' start (issue 39)
    for s in servers:
        loaded = [re.search(r"v(\d+)$", body["model_path"]).group(1) for route, body in s.updates]
        assert loaded[0] == "0", loaded
    # the fleet's state is on the run's own status line (the worker's log line is not at INFO)
    assert re.search(r"rollout servers: \d on the latest version, \d loading, \d out", err), err[-2000:]


def test_a_server_back_from_an_outage_reloads_the_version_before_it_serves(tmp_path):
    """A server that failed its health checks (a restart, on its starting weights) is re-admitted
    only once it has loaded the learner's version again."""
    async def go():
        a, b = await PolicyServer(latency=0.02).start(), await PolicyServer(latency=0.02).start()
        backend = OpenAIBackend("", "policy", servers=[a.url, b.url], update_api="sglang",
                                health_interval_s=0.1, eject_after=1, update_retry_s=0.1)
        try:
            await backend.load_weights(str(tmp_path / "v2"), 2)
            await asyncio.gather(*(backend.generate(["x"], 1, SamplingParams()) for _ in range(4)))
            b.dead = True
            while b.url not in backend.fleet.router.ejected:
                await asyncio.sleep(0.05)
            b.version, b.dead, loads = 0, False, len(b.updates)  # restarted on its starting weights
            while b.url in backend.fleet.router.ejected or backend.fleet.members[b.url].version != 2:
                (group,) = await backend.generate(["x"], 1, SamplingParams())
                assert group[0].text == "v2-v2" and group[0].policy_version == 2
                await asyncio.sleep(0.02)
            served = b.completions
            await asyncio.gather(*(backend.generate(["x"], 1, SamplingParams()) for _ in range(10)))
            return len(b.updates) - loads, b.completions - served
        finally:
            await backend.close()
            await a.stop()
            await b.stop()

    reloads, served_after = asyncio.run(go())
    assert reloads == 1 and served_after > 0


@pytest.mark.parametrize("started_on_v0", [False, True])
def test_servers_load_the_announced_version_0_unless_started_on_it(tmp_path, started_on_v0):
    """Issue 39: ``streamrl run`` announces its warm start as version 0; servers started on
    other weights (here: -1) load it before they serve a request stamped 0; servers started on
    exactly the announced path serve it as they are."""
    async def go():
        servers = [await PolicyServer(latency=0.02, load_s=0.2).start() for _ in range(2)]
        for s in servers:
            s.version = -1  # the weights they were started with
        v0 = str(tmp_path / "v0")
        backend = OpenAIBackend("", "policy", servers=[s.url for s in servers], update_api="sglang",
                                started_on=v0 if started_on_v0 else None)
        try:
            await backend.load_weights(v0, 0)
            groups = await asyncio.gather(*(backend.generate(["x"], 1, SamplingParams()) for _ in range(6)))
            return [g[0][0] for g in groups], [len(s.updates) for s in servers]
        finally:
            await backend.close()
            for s in servers:
                await s.stop()

    answers, loads = asyncio.run(go())
    assert all(c.policy_version == 0 for c in answers)
    if started_on_v0:
        assert loads == [0, 0] and {c.text for c in answers} == {"v-1-v-1"}
    else:
        assert loads == [1, 1] and {c.text for c in answers} == {"v0-v0"}, ([c.text for c in answers], loads)
