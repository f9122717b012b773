"""Helpers for the tests: waiting on a condition, reading topics back, the records and configs
several test files build, the processes of a run, real HTTP servers (and a real Prometheus) in
the test process, and the one reader of what the tests take from other projects (``shared/``
beside the clone). Test modules import from here (and ``math_pairs``, ``deploy``), never from
each other (``test_imports`` checks)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import numpy as np
import pytest
import yaml
from aiohttp import web

from streamrl import testing
from streamrl.broker import free_port
from streamrl.bus import Bus, Message, Reader, TopicPartition
from streamrl.records import DeadLetter, Rewarded, Trajectory

if TYPE_CHECKING:
    import torch

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.samples import Sample

#: the checkout (the tests run ``python -m streamrl`` from here)
ROOT = Path(__file__).resolve().parent.parent


#: beside the clone, as CI lays it: GSM8K (data/gsm8k/) and the deployment schemas (schemas/),
#: which the repository does not carry (it holds only what this project wrote)
SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def shared_path(rel: str) -> Path:
    """A file or folder of ``shared/`` beside the clone; a test that needs one fails (never skips)
    naming the path when it is not there."""
    path = SHARED / rel
    if not path.exists():
        pytest.fail(f"{path} is missing: the tests read it from the shared/ folder beside the clone "
                    f"(as CI lays it); put a copy there", pytrace=False)
    return path


def gsm8k_path(split: str = "test") -> Path:
    """GSM8K's ``train`` or ``test`` split as JSONL rows of ``question`` and ``answer``."""
    return shared_path(f"data/gsm8k/{split}.jsonl")


def gsm8k_run_config() -> list[str]:
    """``streamrl run`` arguments for the embedded pipeline on GSM8K rows from shared/ (the
    packaged ``local-gsm8k.yaml``, no warm start): the tests of the pipeline's mechanics (faults,
    resume, learner ranks, Ray, multi-turn) run at the shapes they were written for; the default
    config's generated task is for the tests of learning."""
    return ["configs/local-gsm8k.yaml", f"feed.dataset={gsm8k_path('train')}"]


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 40.0, what: str = "the condition",
                   *, interval: float = 0.05, fail: bool = True) -> Any:
    """Poll ``predicate()`` until it returns something truthy and return that; at ``timeout_s``
    fail naming ``what`` (``fail=False``: return its last value instead, for a test that asserts
    on it with its own message)."""
    deadline = time.monotonic() + timeout_s
    while not (last := predicate()) and time.monotonic() <= deadline:
        await asyncio.sleep(interval)
    return _result(last, timeout_s, what, fail)


def wait_for_sync(predicate: Callable[[], Any], timeout_s: float = 40.0, what: str = "the condition",
                  *, interval: float = 0.05, fail: bool = True) -> Any:
    """``wait_for`` outside an event loop (it sleeps the thread)."""
    deadline = time.monotonic() + timeout_s
    while not (last := predicate()) and time.monotonic() <= deadline:
        time.sleep(interval)
    return _result(last, timeout_s, what, fail)


def _result(last: Any, timeout_s: float, what: str, fail: bool) -> Any:
    if not last and fail:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
    return last


def last_json_line(stdout: str) -> Any:
    """The JSON object a command prints last (``streamrl run``'s summary, a bench's figures)."""
    return json.loads(stdout.strip().splitlines()[-1])


async def read_topic(bus: Bus, topic: str, n: int | None = None, timeout_s: float = 30.0) -> list[Message]:
    """Read ``n`` messages of ``topic`` from the beginning, without a consumer group; ``n=None``:
    every message up to the topic's end offsets now."""
    if n is None:
        async with Reader(bus, [topic], "test") as reader:
            ends = await reader.end_offsets()
            return [m async for batch in reader.read(stop=ends) for m in batch]
    consumer = bus.consumer([topic], None, "test")
    await consumer.start()
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            out.extend(await consumer.getmany(timeout_ms=200))
    finally:
        await consumer.stop()
    return out


async def committed(bus: Bus, group: str, topic: str = "rewarded") -> dict[int, int | None]:
    """``group``'s committed offset per partition of ``topic`` (None where it has none)."""
    name = bus.topic(topic)
    async with bus.admin() as admin:
        count = (await admin.partition_counts([name]))[name]
        got = await admin.committed(group, [TopicPartition(name, p) for p in range(count)])
    return {tp.partition: off for tp, off in got.items()}


def read_topic_sync(bus: Bus, topic: str, n: int | None = None, timeout_s: float = 30.0) -> list[Message]:
    return asyncio.run(read_topic(bus, topic, n, timeout_s))


async def produce(bus: Bus, records: list, topic: str = "rollouts") -> None:
    """Send ``records`` to ``topic`` and wait for every ack; a ``(key, record)`` pair is sent with
    that key."""
    async with bus.producer("test") as p:
        futs = [await p.send(r, topic=topic) if not isinstance(r, tuple) else
                await p.send_bytes(topic, r[1], key=r[0].encode()) for r in records]
        await asyncio.gather(*futs)


class Collector:
    """Reads ``rewarded`` and ``deadletter`` from the beginning without a group, in the
    background, while the test does other things."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.rewarded: list[Rewarded] = []
        self.partitions: dict[str, int] = {}  # id -> partition (same key, same count as rollouts)
        self.dead: list[DeadLetter] = []

    async def start(self) -> "Collector":
        self.consumer = self.bus.consumer(["rewarded", "deadletter"], None, "test")
        await self.consumer.start()
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.consumer.stop()

    async def __aenter__(self):
        return await self.start()

    async def _run(self):
        dl_topic = self.bus.topic("deadletter")
        while True:
            for m in await self.consumer.getmany(timeout_ms=100):
                if m.topic == dl_topic:
                    self.dead.append(DeadLetter.decode(m.value, 2**26))
                else:
                    self.rewarded.append(Rewarded.decode(m.value))
                    self.partitions[self.rewarded[-1].id] = m.partition

    async def wait(self, predicate, timeout_s: float) -> bool:
        return bool(await wait_for(predicate, timeout_s, interval=0.1, fail=False))

    async def __aexit__(self, *exc):
        await self.stop()


# --- records the tests build -------------------------------------------------------------------

def rewarded_from(traj: Trajectory) -> Rewarded:
    """``traj`` scored 1.0 by a scorer named ``test``."""
    return Rewarded.from_trajectory(traj, reward=1.0, reward_info={"status": "ok"}, scorer={"name": "test"})


def trajectory(i: int | str | None = None, *, tokens: int | None = None, prompt_tokens: int = 16,
               vocab: tuple[int, int] = (0, 2**31 - 1), seed: int = 0, full: bool = False,
               **fields: Any) -> Trajectory:
    """The tests' one trajectory builder, on ``streamrl.testing.trajectory`` (what users' scorer
    tests build): a gsm8k question answered right (``What is six times seven?``, ``#### 42``,
    ground truth ``42``) at version 0, in group ``test`` of 1; ``fields`` (any of
    ``Trajectory``'s) set the rest.

    ``i``: record number ``i``, id ``t-{i}`` in a group of its own (``g-{i}``), ``extra_info``
    ``{"i": str(i)}`` (a scorer, or an assertion, tells the records apart).
    ``tokens``: ``prompt_tokens`` prompt ids and ``tokens`` response ids in ``vocab`` with their
    behaviour log-probs, drawn from ``seed``.
    ``full``: every optional field besides, as the codec and bus tests send: chat messages,
    ``extra_info``, turns, timings and a loss mask (``tokens`` default 64), in group ``g1`` of 4
    at version 7."""
    base: dict[str, Any] = dict(data_source="gsm8k", prompt="What is six times seven?", response="#### 42",
                                ground_truth="42")
    if i is not None:
        base.update(id=f"t-{i}", group_id=f"g-{i}", extra_info={"i": str(i)})
    if full:
        tokens = 64 if tokens is None else tokens
        base.update(group_id="g1", group_size=4, policy_version=7, prompt=[{"role": "user", "content": "What is 6*7?"}],
                    extra_info={"split": "test", "index": 3},
                    turns=[{"role": "assistant", "content": "41"}, {"role": "user", "content": "wrong"}],
                    timings={"generation_started_at": 1.5, "generation_s": 0.25})
    if tokens is not None:
        rng = np.random.default_rng(seed)
        base.update(prompt_ids=rng.integers(*vocab, prompt_tokens, dtype=np.int32),
                    response_ids=rng.integers(*vocab, tokens, dtype=np.int32),
                    response_logprobs=(-rng.exponential(size=tokens)).astype(np.float32))
        if full:
            base.update(response_mask=rng.integers(0, 2, tokens, dtype=np.uint8))
    return testing.trajectory(**{**base, **fields})


#: what the tests of the ``Trainer`` alone (parity across ranks, LoRA, the objectives) step with:
#: a larger rate, micro-batches of 3, clipped gradients
TRAINER: dict[str, Any] = dict(lr=1e-2, micro_batch_size=3, grad_clip=1.0)


def learner_cfg(tmp_path: Path | None = None, *, trainer: bool = False, **kw: Any) -> "LearnerConfig":
    """The tests' one learner config, validated: small batches (2 groups a mini-batch, one
    mini-batch a version, staleness 1), its own consumer group, checkpoints and weights under
    ``tmp_path`` (the current folder when None: a rank that writes only where it is told);
    ``trainer``: ``TRAINER``'s step besides; ``kw`` sets any field over these."""
    from streamrl.learner.config import LearnerConfig

    root = Path(tmp_path) if tmp_path is not None else Path(".")
    base = dict(lr=1e-3, groups_per_mini_batch=2, mini_batches_per_version=1, max_staleness=1,
                group_timeout_s=30.0, checkpoint_dir=str(root / "ckpt"),
                weights_dir=str(root / "weights"), consumer_group=f"learner-{uuid.uuid4().hex[:6]}")
    return LearnerConfig(**{**base, **(TRAINER if trainer else {}), **kw}).validate()


async def publish(bus: Bus, records) -> None:
    """Send rewarded records one by one, each acked before the next (the learner's input order)."""
    async with bus.producer("test") as p:
        for r in records:
            await (await p.send(r))


# --- learner ranks ------------------------------------------------------------------------------

def follow_then_exit(cfg: Any) -> NoReturn:
    """A test's follower rank (``mp.spawn``), as ``streamrl learner``'s followers: follow rank 0
    until its group ends, then leave without the interpreter's teardown, whose C++ destructors
    now and then abort a rank that stopped cleanly ("terminate called without an active
    exception"), which ``mp.spawn`` reports as the rank's failure."""
    from streamrl.learner.ranks import follow

    code = follow(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- the processes of a run --------------------------------------------------------------------

def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def serve_app(app, port: int = 0):
    """Serve an aiohttp ``app`` on 127.0.0.1 (``port`` 0: a free one), as the real judges, reward
    servers and completion servers of the tests do. Returns ``(runner, "http://127.0.0.1:PORT")``;
    ``await runner.cleanup()`` stops it."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class AppServer:
    """A real HTTP server in the test process: a subclass adds its routes in ``routes``;
    ``await start()`` serves them on a free port (``self.url``), ``await stop()`` ends it."""

    _runner: web.AppRunner | None = None
    url = ""

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self):
        app = web.Application()
        self.routes(app)
        self._runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


class JudgeServer(AppServer):
    """A judge speaking the OpenAI chat API: ``POST /v1/chat/completions`` answers ``reply`` (a
    string, or a function of the last message's content) after ``latency`` seconds;
    ``GET /v1/models`` is its health check. ``failing`` makes both answer 503; ``fail_next``
    makes the next N chat requests answer 500."""

    def __init__(self, reply: "str | Callable[[str], str]" = "The answer is right.\nScore: 7",
                 latency: float = 0.0):
        self.reply, self.latency = reply, latency
        self.failing = False
        self.fail_next = 0
        self.chats: list[tuple[float, dict, dict]] = []  # (time, headers, body)
        self.health_checks = 0

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.chats.append((time.monotonic(), dict(request.headers), body))
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.failing:
            return web.Response(status=503, text="down")
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=500, text="boom")
        return web.json_response({
            "id": "c1", "object": "chat.completion", "model": body.get("model", "judge"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": self._reply(body)}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}})

    def _reply(self, body: dict) -> str:
        return self.reply if isinstance(self.reply, str) else self.reply(body["messages"][-1]["content"])

    async def _models(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.failing:
            return web.Response(status=503, text="down")
        return web.json_response({"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)


# --- a real Prometheus -------------------------------------------------------------------------

def binary(name: str) -> str:
    """A tool ``make test`` installs (.ci/test-tools); the test fails naming it when missing."""
    path = shutil.which(name)
    if path is None:
        package = {"bwrap": "bubblewrap", "amtool": "prometheus-alertmanager"}.get(name, "prometheus")
        pytest.fail(f"`{name}` is not on PATH: install Debian's {package} package "
                    f"(apt-get install -y {package}); `make test` does (.ci/test-tools)")
    return path


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PrometheusServer:
    """A Prometheus on a free port with temporary storage, scraping ``targets`` (job -> list of
    HOST:PORT) every second and evaluating the given rule files every second."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]], rule_files: list[Path]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in targets.items()],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.storage = workdir / "tsdb"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PrometheusServer":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.storage}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {self.log_path.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in 30 s: {self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        stop(self.proc)

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=5) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            raise AssertionError(f"{path} {params}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for(self, what: str, check, timeout_s: float):
        """Poll ``check()`` until it returns something truthy; fail naming ``what``."""
        return wait_for_sync(check, timeout_s, what, interval=0.5)


def stage_pid(run_pid: int, verb: str) -> int | None:
    """The pid of a stage process (``python -m streamrl VERB``) under the run."""
    for pid in descendants(run_pid):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"streamrl" in argv and verb.encode() in argv[argv.index(b"streamrl") + 1:][:1] and alive(pid):
            return pid
    return None


def start_run(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m streamrl run ARGS`` from the checkout, its output piped as text (``env`` on top
    of this process's environment)."""
    return subprocess.Popen([sys.executable, "-m", "streamrl", "run", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def kill_stage(proc: subprocess.Popen, verb: str, timeout_s: float = 60) -> None:
    """SIGKILL the run's ``verb`` stage process; one being restarted (or slow to start on a
    loaded machine) is waited for up to ``timeout_s``."""
    pid = wait_for_sync(lambda: proc.poll() is None and stage_pid(proc.pid, verb), timeout_s,
                        f"a {verb} process to kill", interval=0.2)
    os.kill(pid, signal.SIGKILL)


def freeze_stage(proc: subprocess.Popen, verb: str, timeout_s: float = 60) -> int:
    """SIGSTOP the run's ``verb`` stage process and every process under it (a hung process: it
    neither exits nor answers); returns its pid."""
    pid = wait_for_sync(lambda: proc.poll() is None and stage_pid(proc.pid, verb), timeout_s,
                        f"a {verb} process to freeze", interval=0.2)
    for each in [pid, *descendants(pid)]:
        os.kill(each, signal.SIGSTOP)
    return pid


def wait_for_version(runs: Path, at_least: int, proc: subprocess.Popen | None = None, timeout_s: float = 240) -> int:
    """Until a run under ``runs`` (its ``run.out_dir``) has checkpointed version ``at_least``;
    returns the version."""
    from streamrl.resume import latest_good

    def reached() -> int:
        assert proc is None or proc.poll() is None, "the run ended before the version"
        versions = [good[1].version for ckpts in runs.glob("*/checkpoints")
                    if (good := latest_good(ckpts)) is not None]
        return max(versions, default=-1) >= at_least and max(versions)

    return wait_for_sync(reached, timeout_s, f"version {at_least}", interval=0.2)


def status_gaps(err: str) -> list[float]:
    """The seconds between consecutive status lines of a run (their ``| <elapsed>s`` field)."""
    times = [int(m.group(1)) for line in err.splitlines() if line.startswith("version ")
             for m in [re.search(r"\| (\d+)s(?: \||$)", line)] if m]
    return [b - a for a, b in zip(times, times[1:])]


def run_summary(proc: subprocess.Popen, timeout_s: float, during: Callable[[], Any] | None = None
                ) -> tuple[dict, str, str]:
    """Let the ``streamrl run`` process ``proc`` do ``during()`` (the test's kills), then run to
    its end within ``timeout_s``; it must exit 0. Returns its summary (the last JSON line), stdout
    and stderr. Whatever fails on the way, the run is killed, never left behind."""
    try:
        if during is not None:
            during()
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return last_json_line(out), out, err


# -- learner tests' shared data: the ranks' parity batches, the digits task ----------------------
STEPS = 3
#: the parity runs take every path that talks between ranks: recomputed proximal log-probs
#: (decoupled), a sharded KL reference, and a 150-token sequence chunked under a 64-token budget
PARITY = dict(decoupled=True, kl_coef=0.1, max_tokens_per_micro_batch=64)


def parity_batch(seed: int) -> list[Sample]:
    return batch(seed, long=150 if seed == 2 else 0)


def batch(seed: int, n: int = 8, long: int = 0) -> list[Sample]:
    """``n`` samples in groups of 4 with uneven lengths (and one of ``long`` tokens)."""
    from streamrl.learner.samples import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(2, 12))
        r = long - p if long and i == 0 else int(rng.integers(1, 40))
        out.append(Sample(id=f"s{seed}-{i:02d}", group_id=f"g{seed}-{i // 4}", reward=float(rng.random()),
                          policy_version=0, prompt_ids=rng.integers(0, 256, p),
                          response_ids=rng.integers(0, 256, r),
                          behaviour_logprobs=rng.normal(-5.5, 0.3, r).astype(np.float32)))
    return out


GROUPS, GROUP_SIZE, NEW_TOKENS = 4, 8, 8  # the digits task of the learning checks


def sample_groups(model, tok, version: int, round_: int) -> tuple[list[Rewarded], float]:
    """``GROUPS`` groups of the digits task sampled from ``model`` at ``version`` (reward: the
    share of digits in the response), with the behaviour log-probs, as rewarded records."""
    import torch

    prompt_ids = tok("digits:", add_special_tokens=False).input_ids
    digits = set(tok("0123456789", add_special_tokens=False).input_ids)
    n = GROUPS * GROUP_SIZE
    started = time.time()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids] * n), attention_mask=torch.ones(n, len(prompt_ids), dtype=torch.long),
                             do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             return_dict_in_generate=True, output_logits=True)
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # [n, T, V]
    records, rewards = [], []
    for i in range(n):
        resp = out.sequences[i, len(prompt_ids):].tolist()
        lp = logp[i, torch.arange(len(resp)), torch.tensor(resp)].numpy()
        reward = sum(t in digits for t in resp) / len(resp)
        rewards.append(reward)
        records.append(Rewarded(
            id=f"r{round_}-{i}", group_id=f"r{round_}-g{i // GROUP_SIZE}", group_size=GROUP_SIZE,
            policy_version=version, data_source="digits", prompt="digits:", response=tok.decode(resp),
            prompt_ids=prompt_ids, response_ids=resp, response_logprobs=lp,
            timings={"generation_started_at": started}, reward=reward, reward_info={},
            scorer={"name": "digits"}))
    return records, float(np.mean(rewards))


async def announced(bus, learner, version: int):
    """The policy record of ``version``, once ``learner`` has reached it and the topic holds it."""
    from streamrl.learner.versions import read_latest_policy

    await wait_for(lambda: learner.version == version, what=f"version {version}")
    latest = await read_latest_policy(bus)
    while latest is None or latest.version < version:
        await asyncio.sleep(0.05)
        latest = await read_latest_policy(bus)
    return latest


# -- the learner's test records (tests/learner/test_learner_stage.py and the objectives' tests) -------------

_POLICY = {}


def tiny():
    """The tiny policy at its initial weights (what the learner starts from with seed 0)."""
    from streamrl.policy import load_policy

    if "m" not in _POLICY:
        _POLICY["m"] = load_policy("tiny")
    return _POLICY["m"]


def recompute_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0, *, topk: int = 0,
                       grad: bool = False) -> "np.ndarray | torch.Tensor":
    """The tests' by-hand check of every log-prob the code computes: one plain forward of
    ``prompt_ids + response_ids``, log p(each response token | everything before it) at
    ``temperature``, as float32 numpy; ``topk``: the ``topk`` largest log-probs of each position
    instead (``[n, topk]``, a teacher's annotation); ``grad``: the torch tensor, its graph kept
    (a loss computed by hand)."""
    import torch

    ids = torch.tensor(np.concatenate([np.asarray(prompt_ids), np.asarray(response_ids)]).astype(np.int64))[None]
    p, target = len(prompt_ids), torch.tensor(np.asarray(response_ids).astype(np.int64))
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids).logits[0, p - 1:p - 1 + len(target)].float() / temperature
        logp = torch.log_softmax(logits, -1)
        out = torch.topk(logp, topk, -1).values if topk else logp.gather(-1, target[:, None])[:, 0]
    return out if grad else out.numpy()


def group(gid: str, size: int = 2, version: int = 0, *, rewards=None, logprobs: bool = True,
          tokens: bool = True, seed: int = 0) -> list[Rewarded]:
    """``size`` rewarded records of one group with real token ids and behaviour log-probs."""
    model, tok = tiny()
    rng = np.random.default_rng(abs(hash((gid, seed))) % 2**32)
    prompt = f"q{gid}:"
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    out = []
    for i in range(size):
        response_ids = [int(x) for x in rng.integers(65, 91, size=3 + i)]
        response = tok.decode(response_ids)
        reward = float(rewards[i]) if rewards is not None else float(i % 2)
        now = time.time()
        rec = Rewarded(id=f"{gid}-{i}", group_id=gid, group_size=size, policy_version=version,
                       data_source="test", prompt=prompt, response=response,
                       prompt_ids=prompt_ids if tokens else None,
                       response_ids=response_ids if tokens else None,
                       response_logprobs=recompute_logprobs(model, prompt_ids, response_ids)
                       if (logprobs and tokens) else None,
                       timings={"generation_started_at": now - 0.5}, created_at=now - 0.2,
                       reward=reward, reward_info={}, scorer={"name": "test"}, scored_at=now)
        out.append(rec)
    return out


# -- verl's launch scripts (tests/verl/test_verl_scripts.py and the objectives' tests) ------------------

#: a reward file where a script names one (its score does not matter to a dry run)
REWARD_FILE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


def with_reward_files(overrides: list[str], where: Path) -> None:
    """A script's reward file where the script names it (a user runs it from their checkout)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+").endswith("custom_reward_function.path"):
            (where / value).parent.mkdir(parents=True, exist_ok=True)
            (where / value).write_text(REWARD_FILE)


def resolved_script(name: str, where: Path):
    """``resolve_config`` of the verl script ``name``'s overrides (``tests/verl/verl_scripts_data.py``)
    as its author runs it: from ``where``, with its reward file there."""
    from streamrl.pipeline_config import resolve_config
    from tests.verl.verl_scripts_data import SCRIPTS

    overrides = SCRIPTS[name]["overrides"]
    with_reward_files(overrides, where)
    here = os.getcwd()
    os.chdir(where)
    try:
        return resolve_config("local.yaml", overrides)
    finally:
        os.chdir(here)


def distill_samples(vocab: int, k: int, n: int = 4) -> list[Sample]:
    """``n`` samples with a teacher's annotation over ``vocab``: top-``k`` log-probs and ids
    (``k`` 0: the sampled token's log-prob), for the distillation losses' trainer tests."""
    import numpy as np

    from streamrl.learner.samples import Sample

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        r = 3 + i
        top = np.stack([rng.choice(vocab, k, replace=False) for _ in range(r)]) if k else None
        lp = np.log(rng.dirichlet(np.ones(k), r) * 0.9) if k else -rng.random(r) * 3
        out.append(Sample(id=f"s{i}", group_id=f"g{i // 2}", prompt_ids=rng.integers(0, vocab, 2 + i),
                          response_ids=rng.integers(0, vocab, r), reward=float(i % 2), policy_version=0,
                          behaviour_logprobs=(-rng.random(r) * 3).astype(np.float32),
                          teacher_logprobs=lp.reshape(-1).astype(np.float32), teacher_topk=k,
                          teacher_ids=None if top is None else top.reshape(-1)))
    return out


def dry_run(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``streamrl run --dry-run ARGS`` in this process (the CLI's own entry point), from ``cwd``:
    its exit code, stdout and stderr."""
    import contextlib
    import io

    from streamrl.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["run", "--dry-run", *args])
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def tiny_moe(path: Path, seed: int = 0, noise: float = 0.0, experts: int = 8) -> str:
    """A tiny Qwen2-MoE policy directory (``streamrl.policy.tiny_moe_model``: hidden 32, 2 layers,
    ``experts`` experts, top-2, random init from ``seed``; the byte tokenizer), its weights
    perturbed by ``noise`` x each tensor's std where asked (the rollout's weights a little off the
    learner's). Returns the path."""
    from streamrl.policy import byte_tokenizer, perturb, tiny_moe_model

    tok = byte_tokenizer()
    model = tiny_moe_model(len(tok), seed=seed, experts=experts)
    if noise:
        perturb(model, noise, seed + 1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
