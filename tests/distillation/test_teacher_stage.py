"""The teacher stage on the in-memory transport (``streamrl.testing.run_stage``): every record
comes out annotated once on ``distilled`` (or dead-lettered with its reason), with the
teacher's numbers, rewarded records keep their reward, and the learner's sample check accepts
what it publishes; vLLM's ``prompt_logprobs`` read as the same annotation."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.distillation.stage import TeacherStage
from streamrl.distillation.teacher import parse_prompt_logprobs
from streamrl.pipeline_config import load_config
from streamrl.records import Rewarded, Trajectory
from streamrl.testing import run_stage
from tests.helpers import recompute_logprobs, trajectory

OVERRIDES = ["distillation.enabled=true", "teacher.model=tiny", "teacher.batch_size=4"]


def _traj(i: int, **kw) -> Trajectory:
    """Record ``i``: two to a group, 3 to 6 response tokens, every id in the teacher's vocabulary."""
    return trajectory(id=f"t{i}", group_id=f"g{i // 2}", group_size=2, tokens=3 + i % 4, prompt_tokens=4,
                      vocab=(3, 200), seed=i, **kw)


def _rewarded(i: int) -> Rewarded:
    return Rewarded.from_trajectory(_traj(i), reward=float(i % 2), reward_info={"acc": i % 2},
                                    scorer={"name": "gsm8k", "version": "1"})


def _teacher_logprobs(record, topk: int):
    """The tiny teacher's own numbers for ``record`` (what the stage should have attached)."""
    from streamrl.policy import load_policy

    model, _ = load_policy("tiny")
    return recompute_logprobs(model, record.array("prompt_ids"), record.array("response_ids"), topk=topk)


@pytest.mark.parametrize("mode", ["k3", "forward_kl_topk"])
def test_every_rewarded_record_is_annotated_once_with_the_teachers_numbers(mode):
    cfg = load_config(None, OVERRIDES + [f"distillation.distillation_loss.loss_mode={mode}",
                                         "distillation.distillation_loss.topk=5"])
    inputs = [_rewarded(i) for i in range(8)]
    out = run_stage(TeacherStage, inputs, config=cfg, until={"distilled": 8})
    assert out["deadletter"] == [] and out["rewarded"] == []
    got = {r.id: r for r in out["distilled"]}
    assert sorted(got) == sorted(r.id for r in inputs) and len(out["distilled"]) == 8
    topk = 5 if mode == "forward_kl_topk" else 0
    for record in inputs:
        d = got[record.id]
        assert (d.reward, d.reward_info, d.teacher_topk, d.teacher["backend"]) == (record.reward, record.reward_info,
                                                                                   topk, "transformers")
        n = len(record.array("response_ids"))
        lp = d.array("teacher_logprobs").reshape((n, topk) if topk else (n,))
        np.testing.assert_allclose(lp, _teacher_logprobs(record, topk), rtol=1e-4, atol=1e-5)
        assert (d.array("teacher_ids") is None) == (topk == 0)
    # what it publishes, the learner takes
    from streamrl.learner.samples import to_sample

    sample = to_sample(out["distilled"][0], cfg.learner, vocab=1 << 16, tokenizer=None)
    assert sample.teacher_topk == topk and sample.teacher_logprobs is not None


def test_without_task_rewards_it_reads_rollouts_and_dead_letters_what_it_cannot_annotate():
    cfg = load_config(None, OVERRIDES + ["distillation.distillation_loss.use_task_rewards=false"])
    inputs = [_traj(0), _traj(1), trajectory(id="text-only", response="42"),
              _traj(2, prompt_ids=[5, 1 << 20])]  # a token outside the teacher's vocabulary
    out = run_stage(TeacherStage, inputs, config=cfg, until={"distilled": 2, "deadletter": 2})
    assert sorted(r.id for r in out["distilled"]) == ["t0", "t1"]
    assert all(r.reward == 0.0 and r.scorer["name"] == "none" for r in out["distilled"])
    reasons = {d.record_id: (d.stage, d.reason) for d in out["deadletter"]}
    assert reasons == {"text-only": ("teacher", "no_tokens"), "t2": ("teacher", "bad_tokens")}


def test_the_learner_refuses_a_record_without_the_teacher():
    from streamrl.learner.samples import to_sample
    from streamrl.records import RecordError

    cfg = load_config(None, OVERRIDES)
    with pytest.raises(RecordError) as err:
        to_sample(_rewarded(0), cfg.learner, vocab=1 << 16, tokenizer=None)
    assert err.value.reason == "no_teacher"


def test_vllm_prompt_logprobs_read_as_the_annotation():
    prompt, response = np.array([7, 8]), np.array([3, 4])
    entries = [None, {"8": {"logprob": -0.5, "rank": 1}},
               {"3": {"logprob": -1.0, "rank": 2}, "9": {"logprob": -0.2, "rank": 1}},
               {"4": {"logprob": -3.0, "rank": 3}, "9": {"logprob": -0.1, "rank": 1}, "5": {"logprob": -2.0, "rank": 2}}]
    sampled = parse_prompt_logprobs(entries, prompt, response, 0)
    np.testing.assert_allclose(sampled.logprobs, [-1.0, -3.0])
    top = parse_prompt_logprobs(entries, prompt, response, 2)
    np.testing.assert_allclose(top.logprobs, [[-0.2, -1.0], [-0.1, -2.0]])
    assert top.ids.tolist() == [[9, 3], [9, 5]]


def test_a_fleet_of_vllm_servers_through_prompt_logprobs_one_of_them_failing():
    """The openai backend against real HTTP servers speaking vLLM's completions API with
    ``prompt_logprobs``: one answers 500, the other the log-probs; every record comes out with
    the answering server's numbers (the failed call is retried on the next server)."""
    import asyncio

    from aiohttp import web

    from streamrl.testing import run_stage_async
    from tests.helpers import serve_app

    calls = {"bad": 0, "good": 0}

    def logprob(position: int, token: int) -> float:
        return -0.01 * (position + 1) - 0.001 * token

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def bad(request: web.Request) -> web.Response:
        calls["bad"] += 1
        return web.Response(status=500, text="engine died")

    async def good(request: web.Request) -> web.Response:
        calls["good"] += 1
        body = await request.json()
        assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 2
        prompt = body["prompt"]
        entries = [None] + [{str(t): {"logprob": logprob(i, t), "rank": 3},
                             "1": {"logprob": -0.001, "rank": 1}, "2": {"logprob": -0.002, "rank": 2}}
                            for i, t in enumerate(prompt[1:], start=1)]
        return web.json_response({"choices": [{"text": "x", "prompt_logprobs": entries}]})

    async def main():
        apps = []
        for handler in (bad, good):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_get("/health", healthy)
            apps.append(await serve_app(app))
        urls = [f"{url}/v1" for _, url in apps]
        cfg = load_config(None, ["distillation.enabled=true", "teacher.backend=openai", f"teacher.servers={urls}",
                                 "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                 "distillation.distillation_loss.topk=2"])
        from streamrl.testing import memory_bus

        bus = memory_bus()
        cfg.bus = bus.config
        try:
            return await run_stage_async(TeacherStage(cfg, bus), [_rewarded(i) for i in range(4)],
                                         until={"distilled": 4})
        finally:
            for runner, _ in apps:
                await runner.cleanup()

    out = asyncio.run(main())
    assert out["deadletter"] == [] and len(out["distilled"]) == 4 and calls["bad"] >= 1
    for d in out["distilled"]:
        n = len(d.array("response_ids"))
        assert d.teacher_topk == 2 and d.teacher["backend"] == "openai"
        np.testing.assert_allclose(d.array("teacher_logprobs").reshape(n, 2), [[-0.001, -0.002]] * n)
        assert d.array("teacher_ids").reshape(n, 2).tolist() == [[1, 2]] * n


def test_without_task_rewards_the_run_counts_its_rollouts_as_distilled():
    """No reward group runs without task rewards: the teacher takes ``rollouts``, so the run's
    summary accounts for them as distilled (not as "unscored"), and nothing waits on scoring."""
    from streamrl.supervisor.display import summary_line
    from streamrl.supervisor.observer import Observation

    obs = Observation(teacher_input="rollouts", rollouts=10, trained=7,
                      distilled_ids={f"t{i}" for i in range(8)}, teacher_dead={"t8"})
    obs.dead_ids["distilled"].add("t7")
    assert obs.unscored == 0
    r = obs.records()
    assert r["rollouts"] == r["distilled"] + r["dead_at_teacher"] + r["undistilled"] == 10
    assert (r["distilled"], r["dead_at_teacher"], r["undistilled"]) == (8, 1, 1)
    assert r["distilled"] == r["trained"] + r["dead_at_learner"] + r["untrained"] == 8
    summary = {"ended": "done", "versions": 2, "reward_first": None, "reward_last": None, "records": r,
               "deadletters": 2, "plot": "r.png", "by_data_source": {}}
    line = summary_line(summary)
    assert "unscored" not in line and "10 rollouts = 8 distilled + 1 dead-lettered + 1 undistilled, 7 trained" in line
    assert "distillation alone" in line
