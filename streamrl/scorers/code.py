"""Code rewards for verl's code data sources (``codecontests``, ``apps``, ``codeforces``, ``taco``):
the response's code run against the row's test cases, with verl's meaning.

Where the code runs: on a SandboxFusion-compatible service when ``sandbox_fusion_url`` is set
(``streamrl sandbox``, or SandboxFusion itself; verl's ``sandbox_fusion.url``), else on this machine
in the isolated executor (``streamrl.sandbox``: a bubblewrap child, never this process). As in
verl's ``default_compute_score``, the two paths are verl's two scorers:

- with a URL, verl's SandboxFusion scorer: the code is the response's first fenced block (none:
  score 0, ``reason: no_code_block``); a stdin case passes when stdout equals the expected output
  up to trailing newlines; ``assert_case`` rows run the code plus the assert;
- without, verl's ``prime_code``: the code is what follows the last ```` ```python ```` fence; a
  stdin case passes under prime_code's lenient comparison (stripped lines, numbers within
  ``numpy.allclose``), a function case (``fn_name``) when the return value equals the expected
  JSON value.

The score is verl's ``continuous`` score: the share of the first 10 cases that pass (verl scores
those; 1.0 when all cases pass is the same number), or with ``continuous: false`` the share of all
cases. ``reward_info`` gets ``passed``, ``cases``, per-case ``results`` and, below 1, the first
failing case's ``reason`` (``wrong_answer``, ``runtime_error``, ``timeout``, ``compile_error``...).

What is not verl's: a sandbox that cannot serve (connection refused, timeout, 5xx, SandboxError)
raises ``Unavailable``: the reward stage holds the record and retries, where verl scores the case
-1 and the record 0. A ground truth that is not a test-case table is the record's ``Failure``
(``bad_ground_truth``, dead-lettered), where verl scores 0.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from streamrl import metrics
from streamrl.errors import Failure, Unavailable
from streamrl.sandbox import harness

VERSION = "1"
DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CONTINUOUS_CASES = 10  # verl's continuous score reads the first 10 cases

_semaphores: dict[tuple[int, str, int], asyncio.Semaphore] = {}
_executors: dict[tuple[int, bool], Any] = {}  # per event loop: an executor's slot queue is the loop's
_isolation: list[Any] = []  # measured once per process


async def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict[str, Any] | None = None, *, sandbox_fusion_url: str | None = None,
                        max_concurrent: int | None = 64, memory_limit_mb: int | None = 1024, timeout_s: float = 10.0,
                        continuous: bool = True, allow_unisolated: bool = False,
                        **kwargs: Any) -> dict[str, Any]:
    """``{"score", "passed", "cases", "results", "reason"}``. ``max_concurrent``: cases running at
    once in this reward member (verl's ``sandbox_fusion.max_concurrent``); ``memory_limit_mb``:
    each run's memory (verl's ``sandbox_fusion.memory_limit_mb``); ``timeout_s``: each case's wall
    time (verl's 10 s)."""
    memory_limit_mb = int(memory_limit_mb or 1024)  # verl passes None when unset
    max_concurrent = int(max_concurrent or 64)
    table = test_cases(ground_truth)
    flavour = "sandbox_fusion" if sandbox_fusion_url else "prime"
    code = extract_code(solution_str, flavour)
    if code is None:
        return {"score": 0.0, "passed": 0, "cases": 0, "results": [], "reason": "no_code_block"}
    n = len(table["inputs"])
    count = min(n, CONTINUOUS_CASES) if continuous else n
    if count == 0:
        return {"score": 0.0, "passed": 0, "cases": 0, "results": [], "reason": "no_test_cases"}
    limit = _semaphore(sandbox_fusion_url or "local", max(1, int(max_concurrent)))
    run = _remote(sandbox_fusion_url, timeout_s, memory_limit_mb) if sandbox_fusion_url else \
        _local(timeout_s, memory_limit_mb, allow_unisolated)

    async def one(i: int) -> str:
        async with limit:
            return await case(run, code, table, i, flavour)

    try:
        results = list(await asyncio.gather(*(one(i) for i in range(count))))
    finally:
        close = getattr(run, "close", None)
        if close is not None:
            await close()
    backend = "sandbox" if sandbox_fusion_url else "local"
    for r in results:
        metrics.CODE_CASES.labels(backend, r).inc()
    passed = sum(r == "pass" for r in results)
    reason = next((r for r in results if r != "pass"), "")
    return {"score": passed / count, "passed": passed, "cases": count, "results": results, "reason": reason}


def test_cases(ground_truth: Any) -> dict[str, Any]:
    """verl's test-case table: ``{"inputs": [...], "outputs": [...]}`` (stdin / stdout pairs),
    plus ``fn_name`` for function-call cases (each input one JSON value per line, each output a
    JSON value), or ``assert_case`` (code appended to the program, empty stdin). JSON text or a
    dict."""
    table = ground_truth
    if isinstance(table, (str, bytes)):
        try:
            table = json.loads(table)
        except ValueError as exc:
            raise Failure("bad_ground_truth", f"the code test cases are not JSON: {exc}") from None
    if not isinstance(table, dict):
        raise Failure("bad_ground_truth", f"the code test cases are a {type(table).__name__}, not an object "
                                          f"with inputs and outputs")
    table = dict(table)
    asserts = table.get("assert_case")
    if isinstance(asserts, list):
        table.setdefault("inputs", ["" for _ in asserts])
        table.setdefault("outputs", [None for _ in asserts])
    inputs, outputs = table.get("inputs"), table.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise Failure("bad_ground_truth", "the code test cases need lists 'inputs' and 'outputs'")
    if len(inputs) != len(outputs) or (isinstance(asserts, list) and len(asserts) != len(inputs)):
        raise Failure("bad_ground_truth", f"{len(inputs)} inputs but {len(outputs)} outputs"
                      + (f" and {len(asserts)} assert cases" if isinstance(asserts, list) else ""))
    fn = table.get("fn_name")
    if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
        raise Failure("bad_ground_truth", f"fn_name {fn!r} is not a Python name")
    return table


def extract_code(completion: str, flavour: str) -> str | None:
    """The code in a response, as each of verl's scorers takes it (None: no code block)."""
    if flavour == "prime":
        return completion.split("```python")[-1].split("```")[0]
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    parts = completion.split("```")
    code = parts[1]
    if "\n" in code:
        first, rest = code.split("\n", 1)
        if first.strip().isalpha():  # a language tag
            code = rest
    return code


async def case(run: Any, code: str, table: dict[str, Any], i: int, flavour: str) -> str:
    """One case's result: pass, wrong_answer, runtime_error, timeout, compile_error, bad_case."""
    fn = table.get("fn_name")
    given, expected = table["inputs"][i], table["outputs"][i]
    asserts = table.get("assert_case")
    if flavour == "sandbox_fusion":
        source = code + "\n\n" + asserts[i] if isinstance(asserts, list) else code
        stdin = None if given is None else str(given)
        result = await run(harness.program(source, fn, flavour), stdin)
        if result["status"] == "TimeLimitExceeded":
            return "timeout"
        if result["status"] != "Finished" or result["return_code"] != 0:
            return "runtime_error"
        out = result["stdout"] or ""
        if expected is None or str(out).rstrip("\n") == str(expected).rstrip("\n"):
            return "pass"
        return "wrong_answer"
    # prime_code's meaning
    if fn is not None:
        if not isinstance(given, str):
            return "bad_case"
        try:
            want = _keys_as_int(json.loads(expected))
        except (TypeError, ValueError):
            return "bad_case"
        # the value comes back as data from a parent process the code never ran in (harness doc)
        result = await run(harness.program(code, fn, "prime"), given)
        if result["return_code"] == harness.HARNESS_ERROR:
            raise Unavailable("sandbox_error", f"the function-case harness could not run: {str(result.get('stderr', ''))[-300:]}")
        verdict = _ran(result)
        if verdict:
            return verdict
        found, got = harness.returned(result["stdout"])
        if not found:
            return "runtime_error"
        return "pass" if call_matches(got, want) else "wrong_answer"
    if isinstance(given, list):
        given = "\n".join(given)
    if isinstance(expected, list):
        expected = "\n".join(expected)
    if not isinstance(given, str) or not isinstance(expected, str):
        return "bad_case"
    result = await run(harness.program(code, None, "prime"), given)
    verdict = _ran(result)
    if verdict:
        return verdict
    return "pass" if stdout_matches(result["stdout"], expected) else "wrong_answer"


def _ran(result: dict[str, Any]) -> str:
    if result["status"] == "TimeLimitExceeded":
        return "timeout"
    if result["return_code"] == 3:
        return "compile_error"
    if result["return_code"] != 0:
        return "runtime_error"
    return ""


def _keys_as_int(value: Any) -> Any:
    """prime_code turns a JSON object's keys back into ints (a singleton list of one, too)."""
    try:
        if isinstance(value, dict):
            return [{int(k): v for k, v in value.items()}]
    except ValueError:
        pass
    try:
        if isinstance(value[0], dict):
            return [{int(k): v for k, v in value[0].items()}]
    except (ValueError, TypeError, KeyError, IndexError):
        pass
    return value


def call_matches(got: Any, want: Any) -> bool:
    """prime_code's comparison of a function's return value with the expected JSON value."""
    if isinstance(got, tuple):
        got = list(got)
    ok = got == want
    if isinstance(want, list) and want:
        ok = ok or got == want[0]
    try:
        if isinstance(got[0], tuple):
            ok = ok or [list(x) for x in got] == want[0]
    except (TypeError, KeyError, IndexError):
        pass
    return ok is True


def stdout_matches(stdout: str, expected: str) -> bool:
    """prime_code's comparison of a program's stdout with the expected text, in its order: the
    whole text stripped, each line stripped, line lists with blank lines dropped, then numbers
    within ``numpy.allclose`` when not every token pair is all digits."""
    lines = stdout.splitlines()
    want = expected.strip()
    if "\n".join(lines).strip() == want or "\n".join(x.strip() for x in lines).strip() == want:
        return True
    if lines == [expected]:
        return True
    want_lines = [x.strip() for x in expected.split("\n") if x]
    if lines == want_lines:
        return True
    lines = [x for x in lines if x]
    if lines == want_lines:
        return True
    if len(lines) == len(want_lines) and all(_digits(a) and _digits(b) for a, b in zip(lines, want_lines)):
        return False
    # a pair not all digits (or unequal lengths, which prime_code reaches the same way): numbers
    try:
        got_f, want_f = [float(x) for x in lines], [float(x) for x in want_lines]
    except ValueError:
        return False
    if len(got_f) != len(want_f):
        return False
    import numpy as np

    return bool(np.allclose(got_f, want_f))


def _digits(text: str) -> bool:
    return text.isdigit()


def _semaphore(where: str, limit: int) -> asyncio.Semaphore:
    """``max_concurrent`` per member: one semaphore per event loop, backend and limit."""
    key = (id(asyncio.get_running_loop()), where, limit)
    sem = _semaphores.get(key)
    if sem is None:
        sem = _semaphores[key] = asyncio.Semaphore(limit)
    return sem


def _local(timeout_s: float, memory_mb: int, allow_unisolated: bool) -> Any:
    from streamrl.sandbox.isolation import Executor, IsolationError, Limits, probe

    key = (id(asyncio.get_running_loop()), allow_unisolated)
    executor = _executors.get(key)
    if executor is None:
        if not _isolation:
            _isolation.append(probe())
        try:
            executor = Executor(_isolation[0], slots=max(1, len(os.sched_getaffinity(0))),
                                allow_unisolated=allow_unisolated)
        except IsolationError as exc:
            raise Failure("no_isolation", f"code cannot run here: {exc} (or set reward.sandbox_fusion.url "
                                          f"to a streamrl sandbox)") from None
        _executors[key] = executor
    limits = Limits(wall_s=timeout_s, memory_mb=memory_mb)

    async def run(program: str, stdin: str | None) -> dict[str, Any]:
        result = await executor.run("python", program, stdin, limits)
        if result.status == "Error":
            raise Unavailable("sandbox_error", result.stderr[-300:])
        return result.api()

    return run


class _Remote:
    """verl's sandbox client's request, sent with aiohttp from this member's event loop."""

    def __init__(self, url: str, timeout_s: float, memory_mb: int):
        import aiohttp

        self.url, self.timeout_s, self.memory_mb = url, timeout_s, memory_mb
        # verl's request timeout: compile + run + 10 s
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2 * timeout_s + 10))

    async def __call__(self, program: str, stdin: str | None) -> dict[str, Any]:
        import aiohttp

        body = {"compile_timeout": self.timeout_s, "run_timeout": self.timeout_s, "code": program, "stdin": stdin,
                "memory_limit_MB": self.memory_mb, "language": "python", "files": {}, "fetch_files": []}
        last = ""
        for attempt in range(3):
            try:
                async with self.session.post(self.url, json=body) as resp:
                    if resp.status in (502, 503, 504):
                        last = f"HTTP {resp.status}"
                        metrics.CODE_SANDBOX_ERRORS.labels("http").inc()
                        await asyncio.sleep(0.5 * (attempt + 1))
                        continue
                    if resp.status >= 400:
                        text = (await resp.text())[:300]
                        if resp.status >= 500:
                            metrics.CODE_SANDBOX_ERRORS.labels("http").inc()
                            raise Unavailable("sandbox_unavailable", f"{self.url} answered {resp.status}: {text}")
                        raise Failure("sandbox_rejected", f"{self.url} refused the request ({resp.status}): {text}")
                    answer = await resp.json(content_type=None)
            except aiohttp.ClientError as exc:
                metrics.CODE_SANDBOX_ERRORS.labels("connect").inc()
                raise Unavailable("sandbox_unavailable", f"{self.url}: {type(exc).__name__}: {exc}") from None
            except asyncio.TimeoutError:
                metrics.CODE_SANDBOX_ERRORS.labels("timeout").inc()
                raise Unavailable("sandbox_unavailable", f"{self.url}: no answer in {2 * self.timeout_s + 10} s") from None
            return _run_result(answer, self.url)
        raise Unavailable("sandbox_unavailable", f"{self.url}: {last} after 3 attempts")

    async def close(self) -> None:
        await self.session.close()


def _remote(url: str, timeout_s: float, memory_mb: int) -> _Remote:
    return _Remote(url, timeout_s, memory_mb)


def _run_result(answer: Any, url: str) -> dict[str, Any]:
    """The run_result of SandboxFusion's answer, as the case reads it (``status`` TimeLimitExceeded
    / Finished / Error, ``return_code``, ``stdout``); the sandbox's own error is Unavailable."""
    if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed", "SandboxError"):
        metrics.CODE_SANDBOX_ERRORS.labels("bad_response").inc()
        raise Unavailable("sandbox_unavailable", f"{url} answered something that is not SandboxFusion's response")
    if answer["status"] == "SandboxError":
        metrics.CODE_SANDBOX_ERRORS.labels("sandbox_error").inc()
        raise Unavailable("sandbox_error", f"{url}: {str(answer.get('message', ''))[:300]}")
    compiled = answer.get("compile_result") or {}
    if compiled and (compiled.get("status") in ("Error", "TimeLimitExceeded") or compiled.get("return_code") not in (0, None)):
        return {"status": "Finished", "return_code": 3, "stdout": "", "compile_error": True}
    run = answer.get("run_result") or {}
    status = run.get("status")
    if status == "TimeLimitExceeded":
        return {"status": status, "return_code": run.get("return_code"), "stdout": run.get("stdout") or ""}
    if answer["status"] == "Success" and status == "Finished":
        return {"status": "Finished", "return_code": 0, "stdout": run.get("stdout") or ""}
    return {"status": "Finished", "return_code": run.get("return_code") or 1, "stdout": run.get("stdout") or ""}
