"""A server fleet following LoRA versions (issue 39): each version an adapter on a base the
learner publishes once (``base_uri``). The servers are real aiohttp servers in the test process
speaking vLLM's runtime LoRA API (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: 200 and a
line of text, 400/404 with an error object) or SGLang's (``/load_lora_adapter``,
``/unload_lora_adapter``: ``{"success", "error_message"}``), and the OpenAI completions API where
a request names its adapter as the model (vLLM: the adapter's name; SGLang: ``model:adapter``),
answered 404 when no such adapter is loaded, as both do. Each records what would be a
violation on a real server: a request naming an adapter not loaded, an adapter unloaded while a
request that named it runs."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest
from aiohttp import web

from streamrl import metrics
from streamrl.errors import StreamrlError
from streamrl.records import PolicyVersion
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.config import OpenAIBackendConfig, RolloutConfig
from streamrl.rollout.worker import RolloutWorker
from tests.helpers import AppServer
from tests.rollout.streaming import reply


class LoraServer(AppServer):
    """vLLM (``api="vllm"``) or SGLang (``"sglang"``) with runtime LoRA: adapters by name, each
    the version parsed from its path; ``fail_loads`` answers the next adapter loads with an
    error."""

    def __init__(self, api: str, latency: float = 0.1, model: str = "policy", lora: bool = True):
        self.api, self.latency, self.model, self.lora = api, latency, model, lora
        self.adapters: dict[str, int] = {}  # name -> version
        self.running: Counter[str] = Counter()  # adapter -> requests in flight naming it
        self.fail_loads = 0
        self.loads: list[tuple[str, int]] = []  # (name, version), successful
        self.unloads: list[str] = []
        self.base_loads: list[str] = []  # full-weight loads (the base)
        self.violations: list[str] = []
        self.completions = 0

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._ok)
        app.router.add_post("/v1/completions", self._complete)
        prefix = "/v1" if self.api == "vllm" else ""
        if self.lora:  # (vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING has no such routes)
            app.router.add_post(f"{prefix}/load_lora_adapter", self._load)
            app.router.add_post(f"{prefix}/unload_lora_adapter", self._unload)
        app.router.add_post("/update_weights_from_disk", self._full)  # SGLang's full weights
        app.router.add_post("/collective_rpc", self._full)  # vLLM's (streamrl's extension)
        app.router.add_post("/reset_prefix_cache", self._ok)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def _error(self, status: int, message: str) -> web.Response:
        if self.api == "sglang":
            return web.json_response({"success": False, "error_message": message}, status=status)
        return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                                 status=status)

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = str(body["model"])
        if self.api == "sglang":
            base, _, name = model.partition(":")
            if base != self.model:
                self.violations.append(f"request for model {model!r}")
        else:
            name = model
        if name not in self.adapters:
            self.violations.append(f"request named {name!r}, not loaded (loaded: {sorted(self.adapters)})")
            return self._error(404, f"The model `{model}` does not exist.")
        version = self.adapters[name]
        self.running[name] += 1
        try:  # a client that disconnects aborts its request, as vLLM and SGLang do
            deadline = asyncio.get_running_loop().time() + self.latency
            while asyncio.get_running_loop().time() < deadline:
                if request.transport is None or request.transport.is_closing():
                    return web.Response(status=499)
                await asyncio.sleep(0.01)
        finally:
            self.running[name] -= 1
        if self.adapters.get(name) != version:
            self.violations.append(f"{name} changed or unloaded under a request")
        self.completions += 1
        choices = [{"index": i, "text": f"v{version}", "finish_reason": "stop", "token_ids": [5, 6],
                    "prompt_token_ids": [1, 2], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0]}}
                   for i in range(body.get("n", 1))]
        return await reply(request, body, choices)

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        await asyncio.sleep(0.05)
        if self.fail_loads:
            self.fail_loads -= 1
            return self._error(500, "CUDA out of memory while loading the adapter")
        if name in self.adapters:
            return self._error(400, f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = int(re.search(r"v(\d+)$", path).group(1))
        self.loads.append((name, self.adapters[name]))
        if self.api == "sglang":
            return web.json_response({"success": True, "error_message": "",
                                      "loaded_adapters": {n: f"v{v}" for n, v in self.adapters.items()}})
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if name not in self.adapters:
            return self._error(404, f"The lora adapter '{name}' cannot be found.")
        if self.running[name]:
            self.violations.append(f"{name} unloaded with {self.running[name]} requests naming it in flight")
        del self.adapters[name]
        self.unloads.append(name)
        if self.api == "sglang":
            return web.json_response({"success": True, "error_message": "", "loaded_adapters": {}})
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _full(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.base_loads.append(body.get("model_path") or body["args"][0])
        await asyncio.sleep(0.05)
        return web.json_response({"success": True, "message": "ok"})


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_adapters_load_before_requests_name_them_and_unload_after_their_requests(tmp_path, api):
    """Two servers, requests in flight all along, four versions (0 to 3) of adapters on one
    base: the base loads once per server, every version's adapter loads (a failed load is
    retried) before any request names it, each old adapter unloads once its requests are done
    (never under one), and every sample carries the version of the adapter that answered it."""
    async def go():
        a, b = await LoraServer(api).start(), await LoraServer(api).start()
        b.fail_loads = 1
        backend = OpenAIBackend("", "policy", servers=[a.url, b.url], update_api=api, update_retry_s=0.1,
                                update_retry_max_s=0.2, health_interval_s=0)
        base = str(tmp_path / "weights" / "base")
        fails = lambda: metrics.ROLLOUT_SERVER_UPDATE_FAILURES.labels(b.url)._value.get()  # noqa: E731
        failed_before = metrics.ROLLOUT_SERVER_UPDATE_FAILURES.labels(b.url)._value.get()
        aborted_before = metrics.ROLLOUT_REQUESTS_ABORTED._value.get()
        samples, done = [], asyncio.Event()

        async def client(i: int) -> None:
            while not done.is_set():
                (group,) = await backend.generate([f"{i}"], 1, SamplingParams())
                samples.extend(group)

        try:
            await backend.load_weights(str(tmp_path / "weights" / "v0"), 0, base)
            clients = [asyncio.create_task(client(i)) for i in range(4)]
            for v in range(1, 4):
                await asyncio.sleep(0.6)
                await backend.load_weights(str(tmp_path / "weights" / f"v{v}"), v, base)
            while any(m.version != 3 for m in backend.fleet.members.values()):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.4)
            done.set()
            await asyncio.gather(*clients)
            while backend.fleet._retiring:
                await asyncio.sleep(0.05)
            current = {m.url: m.adapter for m in backend.fleet.members.values()}
            return samples, (a, b), current, fails() - failed_before, \
                metrics.ROLLOUT_REQUESTS_ABORTED._value.get() - aborted_before
        finally:
            await backend.close()
            await a.stop()
            await b.stop()

    samples, servers, current, failures, aborted = asyncio.run(go())
    for s in servers:
        assert s.violations == [], s.violations  # loaded before named, never unloaded under a request
        assert s.base_loads == [str(tmp_path / "weights" / "base")]  # the base once
        versions = [v for _, v in s.loads]
        assert versions == sorted(versions) and versions[-1] == 3 and versions[0] == 0, s.loads
        assert list(s.adapters) == [current[s.url]] and s.adapters[current[s.url]] == 3  # the old ones unloaded
        assert sorted(s.unloads) == sorted(n for n, _ in s.loads[:-1])
        assert s.completions > 0
    assert servers[0].loads == [(n, v) for n, v in servers[0].loads] and [v for _, v in servers[0].loads] == [0, 1, 2, 3]
    assert failures == 1  # b's first load failed, was retried
    assert samples and all(s.policy_version == int(s.text.removeprefix("v")) for s in samples)  # true stamps
    assert len({s.policy_version for s in samples}) >= 3  # the fleet followed the versions
    assert aborted == 0  # drain: requests finish on their adapter while the next one loads


def test_abort_cuts_requests_on_the_old_adapter_and_resubmits_them_on_the_new(tmp_path):
    """on_update abort: a long request on v0's adapter is cut when v1 is announced, and answered
    again by v1's adapter (stamped 1); v0's adapter is unloaded afterwards."""
    async def go():
        server = await LoraServer("vllm", latency=1.0).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="vllm", on_update="abort",
                                health_interval_s=0)
        base = str(tmp_path / "base")
        try:
            await backend.load_weights(str(tmp_path / "v0"), 0, base)
            (warm,) = await backend.generate(["x"], 1, SamplingParams())
            request = asyncio.create_task(backend.generate(["1 + 1 ="], 2, SamplingParams()))
            await asyncio.sleep(0.3)
            await backend.load_weights(str(tmp_path / "v1"), 1, base)
            (group,) = await request
            while backend.fleet._retiring:
                await asyncio.sleep(0.05)
            return warm, group, server
        finally:
            await backend.close()
            await server.stop()

    warm, group, server = asyncio.run(go())
    assert warm[0].policy_version == 0 and warm[0].text == "v0"
    assert all(s.policy_version == 1 and s.text == "v1" for s in group)
    assert [v for _, v in server.loads] == [0, 1] and list(server.adapters.values()) == [1]
    assert server.violations == []


def test_launched_servers_take_adapters_when_the_learner_publishes_them():
    """``rollout.servers_launch`` with ``learner.lora`` on: vLLM and SGLang are started with their
    runtime LoRA flags (vLLM's rank rounded up to one it accepts); not with merge_for_servers."""
    from streamrl.pipeline_config import load_config
    from streamrl.rollout.worker import with_lora
    from streamrl.servers.processes import ServerConfig, server_argv

    vllm = with_lora(load_config(None, ["rollout.servers_launch.backend=vllm"]).rollout.servers_launch, 12)
    assert vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv = server_argv(ServerConfig(name="policy", model="m", backend="vllm", args=vllm.args), 8000, role="policy")
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "16"
    sglang = with_lora(load_config(None, ["rollout.servers_launch.backend=sglang"]).rollout.servers_launch, 32)
    assert sglang.args == ["--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "all"]
    assert with_lora(sglang, 32).args == sglang.args  # given flags are kept, not repeated



def test_a_server_without_lora_stops_the_worker_at_start_with_one_line(memory_bus, tmp_path):
    """A vLLM server started without runtime LoRA (no ``/v1/load_lora_adapter``: 404) and a
    learner that publishes adapters: the load is not retried, and the rollout worker stops at
    its first version with one line saying how to start the server (or merge_for_servers)."""
    bus = memory_bus
    cfg = RolloutConfig(backend="openai", group_size=2, openai=OpenAIBackendConfig(
        model="policy", api_key_env="", update_api="vllm", health_interval_s=0))

    async def go():
        server = await LoraServer("vllm", lora=False).start()
        worker = RolloutWorker(bus, RolloutConfig(**{**cfg.__dict__, "servers": [server.url]}))
        producer = bus.producer("learner")
        await producer.start()
        try:
            await producer.send_and_wait(PolicyVersion(version=0, weights_uri=str(tmp_path / "weights" / "v0"),
                                                       base_uri=str(tmp_path / "weights" / "base")))
            with pytest.raises(StreamrlError) as err:
                await asyncio.wait_for(worker.run(), 60)
            retried = metrics.ROLLOUT_SERVER_UPDATE_FAILURES.labels(server.url)._value.get()
            return str(err.value), server, retried
        finally:
            await producer.stop()
            await server.stop()

    message, server, retried = asyncio.run(go())
    print(message)
    assert retried == 0  # not retried: it cannot succeed until the server is restarted
    assert "cannot take LoRA adapters" in message and "--enable-lora" in message and "\n" not in message
    assert server.base_loads == [str(tmp_path / "weights" / "base")] and server.completions == 0


def test_two_rollout_workers_sharing_servers_never_touch_each_others_adapters(tmp_path):
    """Two workers' fleets on the same two servers (a deployment with more workers than servers):
    each loads its own adapter per version and unloads only its own, so neither's requests ever
    name an adapter the other removed; at the end each server holds one adapter per worker."""
    async def go():
        servers = [await LoraServer("vllm", latency=0.1).start() for _ in range(2)]
        backends = [OpenAIBackend("", "policy", servers=[s.url for s in servers], update_api="vllm",
                                  health_interval_s=0) for _ in range(2)]
        base = str(tmp_path / "base")
        samples, done = [], asyncio.Event()

        async def client(backend: OpenAIBackend) -> None:
            while not done.is_set():
                (group,) = await backend.generate(["x"], 1, SamplingParams())
                samples.extend(group)

        try:
            for v in range(3):
                for b in backends:
                    await b.load_weights(str(tmp_path / f"v{v}"), v, base)
                if v == 0:
                    clients = [asyncio.create_task(client(b)) for b in backends for _ in range(2)]
                await asyncio.sleep(0.5)
            while any(m.version != 2 for b in backends for m in b.fleet.members.values()):
                await asyncio.sleep(0.05)
            done.set()
            await asyncio.gather(*clients)
            while any(b.fleet._retiring for b in backends):
                await asyncio.sleep(0.05)
            return samples, servers, [b.fleet.tag for b in backends]
        finally:
            for b in backends:
                await b.close()
            for s in servers:
                await s.stop()

    samples, servers, tags = asyncio.run(go())
    assert tags[0] != tags[1]
    for s in servers:
        assert s.violations == [], s.violations
        assert sorted(s.adapters.values()) == [2, 2] and {n.split("-")[2] for n in s.adapters} == set(tags)
    assert samples and all(x.policy_version == int(x.text.removeprefix("v")) for x in samples)
