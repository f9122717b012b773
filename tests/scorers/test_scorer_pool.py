"""The ``process`` executor's worker pool survives: a member's size does not starve its workers,
a worker that dies is replaced and its record tried again on a fresh one (counted), and only a
record that kills every worker it is given is dead-lettered.

Found in the suite (issue 68): the math scorer answered ``bad_ground_truth`` for ``\\frac{1}{2}``,
then "Abnormal termination" on every retry, and the records went to the dead-letter topic as
``worker_died``. The cause: the worker's memory cap (``reward.process_memory_mb``, 4096 MB) was an
absolute ``RLIMIT_AS``, and a forked worker starts with all of its member's address space (every
thread's stack and malloc arena; a Kafka client holds ~190 MB, a CUDA context tens of GB). The
suite's process had grown near 4 GB, so each new worker was born at its cap. The first test
rebuilds that: this process's address space is made larger than the default cap (an unbacked
read-only reservation: it costs no memory), then many scorings of the same inputs run in parallel.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import textwrap
from pathlib import Path

import pytest

from streamrl import metrics
from streamrl.errors import Failure
from streamrl.scorers.loader import FunctionScorer, ProcessRunner, address_space_bytes

MB = 1024 * 1024
DEFAULT_CAP_MB = 4096  # reward.process_memory_mb's default

pytestmark = pytest.mark.skipif(address_space_bytes() is None, reason="needs /proc (Linux)")


def _deaths(scorer: str) -> float:
    return metrics.REWARD_WORKER_DEATHS.labels(scorer)._value.get()


async def _score_all(scorer: FunctionScorer, cases: list[tuple[str, str]]) -> list[object]:
    async def one(response: str, truth: str) -> object:
        try:
            return (await scorer("math", response, truth))["score"]
        except Failure as exc:
            return f"{exc.reason}: {exc.detail[:120]}"

    return await asyncio.gather(*(one(r, t) for r, t in cases))


def test_workers_of_a_member_larger_than_the_cap_score_under_load():
    """48 scorings of the records that died, 4 workers, from a member whose address space is past
    the default cap: before the fix every one was ``worker_died``; now each has its verdict and
    no worker died."""
    held = max(0, DEFAULT_CAP_MB * MB + 256 * MB - address_space_bytes())
    reserve = mmap.mmap(-1, held, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ) if held else None
    assert address_space_bytes() > DEFAULT_CAP_MB * MB
    runner = ProcessRunner(4, DEFAULT_CAP_MB)
    # budgets far above the work: on a loaded machine a cold worker's first parse (SymPy's and
    # the LaTeX parser's set-up) can take seconds; this test is about memory, not time
    scorer = FunctionScorer("streamrl.scorers.math_verify:compute_score", name="pool-math",
                            kwargs=dict(parse_timeout_s=120.0, verify_timeout_s=120.0),
                            executor="process", runner=runner, timeout_s=300.0)
    cases = [("so $\\boxed{0.5}$", "\\frac{1}{2}"), ("$\\boxed{\\frac{1}{3}}$", "\\frac{1}{2}"),
             ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}")] * 16
    before = _deaths("pool-math")
    try:
        scores = asyncio.run(_score_all(scorer, cases))
    finally:
        runner.close()
        if reserve is not None:
            reserve.close()
    assert scores == [1.0, 0.0, 1.0] * 16
    assert _deaths("pool-math") == before


USER_SCORERS = """
import os, signal
from pathlib import Path

def dies_once(data_source, solution_str, ground_truth, extra_info=None):
    '''Kills its own worker the first time it sees a record, then scores it.'''
    mark = Path(ground_truth) / solution_str
    if not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0

def always_dies(data_source, solution_str, ground_truth, extra_info=None):
    os.kill(os.getpid(), signal.SIGKILL)

def grows(data_source, solution_str, ground_truth, extra_info=None):
    '''A runaway: more memory than the cap allows above what the worker inherits.'''
    hoard = bytearray(int(solution_str) * 1024 * 1024)
    return float(len(hoard) > 0)

def worker_pid(data_source, solution_str, ground_truth, extra_info=None):
    return float(os.getpid())
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool_scorers.py"
    path.write_text(textwrap.dedent(USER_SCORERS))
    return path


def _scorer(user_file: Path, fn: str, runner: ProcessRunner) -> FunctionScorer:
    return FunctionScorer(f"{user_file}:{fn}", name=f"pool-{fn}", executor="process", runner=runner,
                          timeout_s=60.0)


def test_a_worker_that_dies_is_replaced_and_its_record_retried(user_file: Path, tmp_path: Path):
    """Six records each kill the worker that first runs them: all six are scored on fresh workers,
    six deaths counted. A record that kills every worker is ``worker_died`` after the retries, and
    the pool goes on scoring."""
    runner = ProcessRunner(2, 256)
    dies_once, always = _scorer(user_file, "dies_once", runner), _scorer(user_file, "always_dies", runner)
    before_once, before_always = _deaths("pool-dies_once"), _deaths("pool-always_dies")

    async def run() -> tuple[list[object], str]:
        scores = await asyncio.gather(*(dies_once("d", f"r{i}", str(tmp_path)) for i in range(6)))
        with pytest.raises(Failure) as err:
            await always("d", "x", "y")
        return list(scores), f"{err.value.reason}: {err.value.detail}"

    try:
        scores, failure = asyncio.run(run())
        assert scores == [1.0] * 6
        assert _deaths("pool-dies_once") - before_once == 6
        assert failure.startswith("worker_died:") and f"each of {ProcessRunner.WORKER_RETRIES + 1} workers" in failure
        assert _deaths("pool-always_dies") - before_always == ProcessRunner.WORKER_RETRIES + 1
        assert asyncio.run(dies_once("d", "r0", str(tmp_path))) == 1.0  # the pool still serves
    finally:
        runner.close()


def test_a_pool_whose_idle_workers_all_died_is_built_anew(user_file: Path):
    """Workers killed while idle (the OOM killer's choice, an operator) break a pebble pool for
    good ("All workers expired"); the next record gets a new pool."""
    runner = ProcessRunner(1, 256)
    pid = _scorer(user_file, "worker_pid", runner)
    try:
        first = int(asyncio.run(pid("d", "s", "g")))
        os.kill(first, 9)
        second = int(asyncio.run(pid("d", "s", "g")))
        assert second != first
    finally:
        runner.close()


def test_the_cap_still_stops_a_runaway_in_its_worker(user_file: Path):
    """``process_memory_mb`` is what a worker may add to what it inherits: 64 MB more fits under a
    256 MB cap, 1 GB is ``memory``, and the worker that hit the cap goes on."""
    runner = ProcessRunner(1, 256)
    grows = _scorer(user_file, "grows", runner)
    try:
        assert asyncio.run(grows("d", "64", "g")) == 1.0
        with pytest.raises(Failure) as err:
            asyncio.run(grows("d", "1024", "g"))
        assert err.value.reason == "memory"
        assert asyncio.run(grows("d", "64", "g")) == 1.0
    finally:
        runner.close()
