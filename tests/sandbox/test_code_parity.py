"""The code rule against verl's own code scorers, on generated problems in both test-case formats:

- without a sandbox URL, against verl's ``prime_code`` (its checks run in this test process's
  children, as verl runs them; its 5 s / 10 s timeouts set to ``TIMEOUT_S``, ours the same);
- with a URL, against verl's SandboxFusion scorer, both calling the same real ``streamrl sandbox``
  (so this is also verl's own client code path against the service).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamrl.scorers.code import compute_score
from tests.sandbox.code_cases import assert_cases, cases
from tests.sandbox.conftest import verl_package

#: both sides' time limit per test input: the slow case sleeps 30 s, and a correct answer must
#: never reach it (at 1 s, a correct case timed out three times in the loaded suite: CI's
#: machine runs four workers on two cores, and every case here starts its processes at once)
TIMEOUT_S = 5
pytestmark = pytest.mark.xdist_group("sandbox-parity")  # one service for the module's tests


def verl_prime(response: str, ground_truth: str) -> float:
    pc = verl_package("prime_code")
    check = pc.apps_check_correctness

    def scaled(in_outs, generation, timeout=10, debug=False):
        return check(in_outs=in_outs, generation=generation, timeout=TIMEOUT_S, debug=debug)

    pc.apps_check_correctness = scaled
    try:
        score, _ = pc.compute_score(response, ground_truth, continuous=True)
    finally:
        pc.apps_check_correctness = check
    return float(score)


def test_local_scores_equal_verl_prime_code():
    """Every generated case: the same score as verl's prime_code (as default_compute_score calls
    it, continuous)."""
    mine_all = asyncio.run(_score_all([(c.response, c.ground_truth) for c in cases()], timeout_s=TIMEOUT_S))
    differ = []
    for case, mine in zip(cases(), mine_all):
        theirs = verl_prime(case.response, case.ground_truth)
        if mine["score"] != theirs:
            differ.append((case.name, mine["score"], theirs, mine["results"]))
    assert not differ, differ
    by_name = {c.name: m for c, m in zip(cases(), mine_all)}
    # the set covers passes, partial credit and each kind of failure
    assert by_name["sum/correct"]["score"] == 1.0 and by_name["add/correct"]["score"] == 1.0
    assert 0 < by_name["sum/wrong_on_some"]["score"] < 1
    assert by_name["sum/slow"]["reason"] == "timeout"
    assert by_name["sum/crash"]["reason"] == "runtime_error"
    assert by_name["sum/syntax_error"]["reason"] == "compile_error"
    assert by_name["add/wrong"]["reason"] == "wrong_answer"


def test_sandbox_scores_equal_verl_sandbox_fusion(sandbox_service):
    """verl's SandboxFusion scorer and ours, on the same service: the same scores, and verl's
    client reads every answer (no api_error)."""
    _, url = sandbox_service
    sf = verl_package("sandbox_fusion")
    generated = [*cases(slow=True), *assert_cases()]
    semaphore = threading.Semaphore(4)
    theirs = []
    for case in generated:
        score, meta = sf.compute_score(f"{url}/run_code", semaphore, 256, case.response, case.ground_truth,
                                       continuous=True, timeout=TIMEOUT_S)
        assert all(m.get("status") != "api_error" for m in meta), (case.name, meta)
        theirs.append(float(score))
    mine = asyncio.run(_score_all([(c.response, c.ground_truth) for c in generated], timeout_s=TIMEOUT_S,
                                  sandbox_fusion_url=f"{url}/run_code", memory_limit_mb=256))
    differ = [(c.name, m["score"], t, m["results"]) for c, m, t in zip(generated, mine, theirs) if m["score"] != t]
    assert not differ, differ
    by_name = {c.name: m for c, m in zip(generated, mine)}
    assert by_name["sum/correct"]["score"] == 1.0 and by_name["assert/correct"]["score"] == 1.0
    assert by_name["sum/float"]["score"] == 0.0  # SandboxFusion's exact comparison, unlike prime_code's
    assert by_name["sum/unfenced"]["reason"] == "no_code_block"


def test_verl_client_request_reads_our_response(sandbox_service):
    """verl's ``call_sandbox_api`` (its exact request) gets SandboxFusion's response fields."""
    _, url = sandbox_service
    utils = verl_package("sandbox_fusion").utils
    answer, error = utils.call_sandbox_api(f"{url}/run_code", "print(input()[::-1])", "abc", 5, 5, 256, "python")
    assert error is None
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "cba\n"
    assert answer["run_result"]["status"] == "Finished" and answer["run_result"]["return_code"] == 0
    answer, error = utils.call_sandbox_api(f"{url}/run_code", "echo hi; exit 4", None, 5, 5, 256, "bash")
    assert error is None and answer["status"] == "Failed" and answer["run_result"]["return_code"] == 4
    answer, error = utils.call_sandbox_api(f"{url}/run_code", "while True: pass", None, 1, 1, 256, "python")
    assert answer["status"] == "Failed" and answer["run_result"]["status"] == "TimeLimitExceeded"


@pytest.mark.parametrize("ground_truth", ["not json", "[1, 2]", '{"inputs": ["1"]}', '{"inputs": ["1"], "outputs": []}',
                                          '{"inputs": [], "outputs": [], "fn_name": "os.system"}'])
def test_a_bad_test_case_table_is_the_records_failure(ground_truth):
    from streamrl.errors import Failure

    with pytest.raises(Failure) as err:
        asyncio.run(compute_score("apps", "```python\nprint(1)\n```", ground_truth))
    assert err.value.reason == "bad_ground_truth"


async def _score_all(items, **kwargs):
    return await asyncio.gather(*(compute_score("apps", r, g, **kwargs) for r, g in items))
