"""The code rule in the reward stage: verl's sandbox keys (both generations) reach it; a sandbox
outage holds the record (Unavailable, counted), never a score of 0, and the record is scored once
the sandbox answers; misbehaving code is a failure score with its reason; the local path runs
isolated; a service below the minimum isolation refuses to start unless opted out by name."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from streamrl import metrics
from streamrl.errors import Unavailable
from streamrl.net import free_port
from streamrl.pipeline_config import load_config
from streamrl.reward.stage import RewardStage
from streamrl.sandbox.isolation import Executor, Isolation, IsolationError, Limits, probe
from streamrl.sandbox.server import ServiceLimits, build_app
from streamrl.scorers.code import compute_score
from streamrl.testing import run_stage_async, score, trajectory
from tests.helpers import binary, serve_app, wait_for
from tests.sandbox.code_cases import fenced

SUM = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs))"
TABLE = json.dumps({"inputs": ["2\n1 2\n", "3\n4 5 6\n"], "outputs": ["3\n", "15\n"]})


@pytest.mark.parametrize("prefix", ["", "reward."])
def test_verls_sandbox_keys_reach_the_code_rule(prefix):
    cfg = load_config(None, [f"{prefix}sandbox_fusion.url=http://sandbox:8080/run_code",
                             f"{prefix}sandbox_fusion.max_concurrent=8", f"{prefix}sandbox_fusion.memory_limit_mb=512"])
    spec = cfg.reward.scorers["code"]
    assert spec.kwargs == {"sandbox_fusion_url": "http://sandbox:8080/run_code", "max_concurrent": 8,
                           "memory_limit_mb": 512}


def test_the_code_families_are_routed_and_scored_locally():
    """codecontests, apps, codeforces and taco go to the code rule; no URL: local, isolated."""
    binary("bwrap")
    records = [trajectory(id=f"r{i}", data_source=ds, response=fenced(SUM if i % 2 == 0 else SUM + " + 1"),
                          ground_truth=TABLE)
               for i, ds in enumerate(["codecontests", "apps", "codeforces", "taco"])]
    out = score(records)
    assert [r.reward for r in out] == [1.0, 0.0, 1.0, 0.0]
    assert out[1].reward_info["reason"] == "runtime_error" and out[1].reward_info["passed"] == 0
    assert out[0].scorer["name"] == "code"


def test_an_outage_holds_the_record_until_the_sandbox_answers():
    """No sandbox at the URL: the record is held (counted as unavailable), not scored 0 nor
    dead-lettered; the sandbox comes up on that port and the record is scored."""
    binary("bwrap")
    port = free_port()
    cfg = load_config(None, [f"reward.scorers.code.kwargs.sandbox_fusion_url=http://127.0.0.1:{port}/run_code",
                             "reward.retry_backoff_s=0.2", "reward.unavailable_backoff_max_s=0.5"])
    errors = metrics.CODE_SANDBOX_ERRORS.labels("connect")

    async def main():
        before = errors._value.get()
        stage = asyncio.ensure_future(run_stage_async(
            RewardStage, [trajectory(id="held", data_source="apps", response=fenced(SUM), ground_truth=TABLE)],
            config=cfg, until={"rewarded": 1}, timeout_s=60))
        await wait_for(lambda: errors._value.get() >= before + 2, 30, "the scorer to find the sandbox down")
        assert not stage.done()
        app = build_app(Executor(probe(), slots=2), ServiceLimits())
        runner, _ = await serve_app(app, port)
        try:
            return await stage
        finally:
            await runner.cleanup()

    out = asyncio.run(main())
    assert [r.reward for r in out["rewarded"]] == [1.0] and out["deadletter"] == []


class BrokenSandbox:
    """A SandboxFusion that answers SandboxError (its own failure) or HTTP 503."""

    def __init__(self, how: str):
        self.how = how

    async def handle(self, request: web.Request) -> web.Response:
        if self.how == "503":
            return web.Response(status=503, text="overloaded")
        return web.json_response({"status": "SandboxError", "message": "runner crashed", "run_result": None})


@pytest.mark.parametrize("how", ["sandbox_error", "503"])
def test_a_sandbox_that_cannot_serve_is_unavailable_not_zero(how):
    async def main():
        app = web.Application()
        app.router.add_post("/run_code", BrokenSandbox(how).handle)
        runner, url = await serve_app(app)
        try:
            with pytest.raises(Unavailable):
                await compute_score("apps", fenced(SUM), TABLE, sandbox_fusion_url=f"{url}/run_code")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_max_concurrent_bounds_the_runs_of_a_member():
    """max_concurrent: cases in flight at once in this member, whatever the records."""
    seen = {"now": 0, "most": 0}

    async def handle(request: web.Request) -> web.Response:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        await asyncio.sleep(0.05)
        seen["now"] -= 1
        body = await request.json()
        lines = body["stdin"].split("\n")
        out = str(sum(map(int, lines[1].split()))) + "\n"
        return web.json_response({"status": "Success", "message": "", "compile_result": None,
                                  "run_result": {"status": "Finished", "return_code": 0, "stdout": out, "stderr": "",
                                                 "execution_time": 0.05}})

    async def main():
        app = web.Application()
        app.router.add_post("/run_code", handle)
        runner, url = await serve_app(app)
        try:
            return await asyncio.gather(*(compute_score("apps", fenced(SUM), TABLE, sandbox_fusion_url=f"{url}/run_code",
                                                        max_concurrent=3) for _ in range(6)))
        finally:
            await runner.cleanup()

    assert [r["score"] for r in asyncio.run(main())] == [1.0] * 6
    assert seen["most"] == 3


def test_below_the_minimum_the_executor_and_the_service_refuse_unless_opted_out():
    weak = Isolation("none", "", {"bubblewrap": False}, problems=("bubblewrap is not installed",))
    with pytest.raises(IsolationError, match="--allow-unisolated"):
        Executor(weak)
    ran = asyncio.run(Executor(weak, allow_unisolated=True).run("python", "print(6 * 7)", None, Limits(wall_s=5)))
    assert ran.stdout == "42\n"
    # the service (services/sandbox.py: the verb) with no bwrap on PATH: exit 2 naming the opt-out
    service = Path(__file__).resolve().parents[2] / "services" / "sandbox.py"
    done = subprocess.run([sys.executable, str(service), "--port", "0"], capture_output=True,
                          text=True, env={"PATH": "/nonexistent", "PYTHONPATH": ":".join(sys.path)}, timeout=60)
    assert done.returncode == 2 and "--allow-unisolated" in done.stderr and "bubblewrap" in done.stderr



def test_short_programs_in_a_row_on_one_slot_all_run_and_a_forged_start_failure_never_passes():
    """bubblewrap's fork of the namespace's first process fails (EAGAIN) while the slot's uid is
    at its process limit, and the kernel counts an exited program's processes for a while after
    they are reaped: one slot at ``--processes 32`` (the parity tests' service) refused 181 of 200
    short programs in a row, and correct code scored as a runtime error. Sixty in a row on one
    slot now all run. A program that prints bubblewrap's error and exits 1 gets its failed run
    after the retries: never a pass, and never ``Error`` (on which the scorer would hold its
    record, and its partition, for good)."""
    binary("bwrap")
    executor = Executor(probe(), slots=1, uid_base=63000)  # a uid range no other test runs under
    limits = Limits(wall_s=5, memory_mb=256, processes=32, scratch_mb=16)

    async def main():
        ran = [await executor.run("python", "print(6 * 7)", None, limits) for _ in range(60)]
        forged = await executor.run("python", "import sys\nsys.stderr.write(\"bwrap: Can't fork for pid 1: "
                                    "Resource temporarily unavailable\\n\")\nsys.exit(1)", None, limits)
        return ran, forged

    ran, forged = asyncio.run(main())
    assert [(r.return_code, r.stdout) for r in ran] == [(0, "42\n")] * 60, [r.stderr for r in ran if r.return_code]
    assert (forged.status, forged.return_code, forged.stdout) == ("Finished", 1, ""), forged
    assert forged.stderr.endswith("bubblewrap refused the start 6 times"), forged
