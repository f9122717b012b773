"""Several teachers, one per data source (verl's ``distillation.teacher_models``): the config read
as verl reads it (its single ``teacher_model`` dropped beside others, said at start), each
teacher's stage annotating its own data source and passing over the others', a data source no
teacher serves trained without distillation or dead-lettered as configured, the learner taking
such a record, and a teacher whose tokenizer is not the student's refused naming both."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from streamrl.distillation.stage import TeacherStage
from streamrl.errors import ConfigError
from streamrl.pipeline_config import load_config
from streamrl.records import Rewarded, Trajectory
from streamrl.testing import memory_bus, run_stage
from tests.helpers import ROOT, distill_samples, recompute_logprobs, trajectory

SOURCES = ("gsm8k", "geo", "code")  # math's, geo's, no teacher's
TWO = ["distillation.enabled=true", "teacher.batch_size=4",
       "+distillation.teacher_models.math.key=gsm8k", "+distillation.teacher_models.math.model_path=tiny",
       "distillation.teacher_models.math.seed=1",
       "+distillation.teacher_models.geo.key=geo", "+distillation.teacher_models.geo.model_path=tiny",
       "distillation.teacher_models.geo.seed=2"]


def _rewarded(i: int) -> Rewarded:
    traj: Trajectory = trajectory(id=f"t{i}", group_id=f"g{i}", group_size=1, tokens=3 + i % 3, prompt_tokens=4,
                                  vocab=(3, 200), seed=i, data_source=SOURCES[i % 3])
    return Rewarded.from_trajectory(traj, reward=1.0, reward_info={}, scorer={"name": "gsm8k", "version": "1"})


def _model(seed: int):
    from streamrl.policy import load_policy

    return load_policy("tiny", seed=seed)[0]


@pytest.mark.parametrize("name", ["math", "geo"])
def test_each_teacher_annotates_its_own_data_source_only_and_the_first_hands_on_the_rest(name):
    cfg = load_config(None, TWO + [f"teacher.name={name}"])
    inputs = [_rewarded(i) for i in range(9)]
    mine = {"math": "gsm8k", "geo": "geo"}[name]
    want = {r.id for r in inputs if r.data_source == mine} | ({r.id for r in inputs if r.data_source == "code"}
                                                               if name == "math" else set())
    out = run_stage(TeacherStage, inputs, config=cfg, until={"distilled": len(want)})
    assert out["deadletter"] == [] and {d.id for d in out["distilled"]} == want and len(out["distilled"]) == len(want)
    model = _model({"math": 1, "geo": 2}[name])
    for d in out["distilled"]:
        if d.data_source == "code":  # no teacher serves it: trained without distillation (teacher.unserved: train)
            assert d.teacher["unserved"] and len(d.array("teacher_logprobs")) == 0 and d.reward == 1.0
            continue
        assert (d.teacher["name"], d.teacher["key"]) == (name, mine)
        np.testing.assert_allclose(d.array("teacher_logprobs"),
                                   recompute_logprobs(model, d.array("prompt_ids"), d.array("response_ids")),
                                   rtol=1e-4, atol=1e-5)


def test_a_data_source_no_teacher_serves_is_dead_lettered_when_configured_and_counted():
    from streamrl import metrics

    before = metrics.TEACHER_UNSERVED.labels("deadletter")._value.get()
    cfg = load_config(None, TWO + ["teacher.name=math", "teacher.unserved=deadletter"])
    inputs = [_rewarded(i) for i in range(6)]
    out = run_stage(TeacherStage, inputs, config=cfg, until={"distilled": 2, "deadletter": 2})
    assert sorted(d.id for d in out["distilled"]) == ["t0", "t3"]
    letters = {d.record_id: (d.stage, d.reason) for d in out["deadletter"]}
    assert letters == {"t2": ("teacher", "no_teacher"), "t5": ("teacher", "no_teacher")}
    assert "code" in out["deadletter"][0].detail
    assert metrics.TEACHER_UNSERVED.labels("deadletter")._value.get() - before == 2


def test_the_learner_trains_a_record_no_teacher_serves_without_distillation():
    """``teacher.unserved: train``: the learner takes the record (no ``no_teacher`` refusal), its
    sample carries no teacher, and its tokens add nothing to the distillation loss: a step on it
    and an annotated record gives the distillation figures of the annotated record alone."""
    from streamrl.learner.samples import to_sample

    cfg = load_config(None, TWO + ["teacher.name=math"])
    out = run_stage(TeacherStage, [_rewarded(0), _rewarded(2)], config=cfg, until={"distilled": 2})
    by_id = {d.id: d for d in out["distilled"]}
    unserved = to_sample(by_id["t2"], cfg.learner, vocab=1 << 16, tokenizer=None)
    served = to_sample(by_id["t0"], cfg.learner, vocab=1 << 16, tokenizer=None)
    assert unserved.teacher_logprobs is None and served.teacher_logprobs is not None


def test_verl_multi_teacher_keys_through_dry_run_with_the_teacher_model_drop():
    """verl's own example of its note: ``teacher_model`` with ``teacher_model2`` added runs
    ``teacher_model2`` alone, and the drop is said; named ``teacher_model1`` both run."""
    def dry(*keys: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamrl", "run", "--dry-run", "distillation.enabled=true",
                               *keys], cwd=ROOT, capture_output=True, text=True, timeout=120)

    dropped = dry("distillation.teacher_models.teacher_model.key=openai/gsm8k",
                  "distillation.teacher_models.teacher_model.model_path=tiny",
                  "+distillation.teacher_models.teacher_model2.key=hiyouga/geometry3k",
                  "+distillation.teacher_models.teacher_model2.model_path=tiny",
                  "distillation.teacher_models.teacher_model2.inference.tensor_model_parallel_size=2",
                  "distillation.teacher_key=data_source")
    assert dropped.returncode == 0, dropped.stderr
    out = dropped.stdout
    assert ("# distillation.teacher_models.teacher_model is dropped: as in verl, the single teacher's entry is "
            "removed when others are added (teacher_model2)") in out
    assert ("#   +distillation.teacher_models.teacher_model2.key=hiyouga/geometry3k -> "
            "distillation.teacher_models.teacher_model2.key=hiyouga/geometry3k") in out
    assert "teacher_model2.{inference.tensor_model_parallel_size}: not applicable here" in out
    teachers = next(line for line in out.splitlines() if line.startswith("# teachers: "))
    assert teachers == ("# teachers: teacher_model2 (hiyouga/geometry3k: transformers tiny, 1 members, "
                        "group streamrl-teacher-teacher_model2)")
    kept = dry("+distillation.teacher_models.teacher_model1.key=openai/gsm8k",
               "+distillation.teacher_models.teacher_model1.model_path=tiny",
               "+distillation.teacher_models.teacher_model2.key=hiyouga/geometry3k",
               "+distillation.teacher_models.teacher_model2.model_path=tiny")
    assert kept.returncode == 0 and "is dropped" not in kept.stdout
    teachers = next(line for line in kept.stdout.splitlines() if line.startswith("# teachers: "))
    assert "teacher_model1 (openai/gsm8k" in teachers and "teacher_model2 (hiyouga/geometry3k" in teachers
    # verl's checks: a key per teacher, unique, and a model path
    bad = dry("+distillation.teacher_models.a.key=x", "+distillation.teacher_models.a.model_path=tiny",
              "+distillation.teacher_models.b.key=x", "+distillation.teacher_models.b.model_path=tiny")
    assert bad.returncode == 2 and "'distillation.teacher_models.b.key': duplicate teacher key 'x'" in bad.stderr
    bad = dry("+distillation.teacher_models.a.key=x", "+distillation.teacher_models.a.model_path=tiny",
              "+distillation.teacher_models.b.model_path=tiny")
    assert bad.returncode == 2 and "'distillation.teacher_models.b.key': must be specified" in bad.stderr


def test_the_config_reads_teachers_as_verl_does():
    cfg = load_config(None, TWO + ["run.teacher_members=2", "distillation.teacher_models.geo.members=3"])
    teachers = cfg.distillation.teachers(cfg.teacher)
    assert [(t.name, t.key, t.config.seed, t.members) for t in teachers.values()] == [("math", "gsm8k", 1, 0),
                                                                                     ("geo", "geo", 2, 3)]
    assert teachers["geo"].group("streamrl-teacher") == "streamrl-teacher-geo"
    one = load_config(None, ["distillation.enabled=true", "+distillation.teacher_models.only.key=gsm8k",
                             "+distillation.teacher_models.only.model_path=tiny"])
    (only,) = one.distillation.teachers(one.teacher).values()
    assert only.key == "gsm8k" and not one.distillation.routed  # verl: a sole teacher takes every record
    none = load_config(None, ["distillation.enabled=true"])
    assert [(t.name, t.key, t.config.model) for t in none.distillation.teachers(none.teacher).values()] == [
        ("", "default", "tiny")]
    with pytest.raises(ConfigError, match="'teacher.unserved': train leaves a record"):
        load_config(None, TWO + ["distillation.distillation_loss.use_task_rewards=false"])
    with pytest.raises(ConfigError, match="'teacher.name' \\(--teacher\\): with several teachers"):
        TeacherStage(load_config(None, TWO + ["teacher.name=nobody"]), memory_bus())


def test_a_teacher_whose_tokenizer_is_not_the_students_is_refused_naming_both(tmp_path):
    from streamrl.policy import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    model = tiny_model(len(tok), seed=3)
    model.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    cfg = load_config(None, TWO[:-1] + [f"distillation.teacher_models.geo.model_path={tmp_path / 'teacher'}",
                                       "teacher.name=math"])
    with pytest.raises(ConfigError) as err:
        TeacherStage(load_config(None, TWO[:-2] + [f"distillation.teacher_models.geo.model_path={tmp_path / 'teacher'}",
                                                  "teacher.name=geo"]))
    message = str(err.value)
    assert "distillation.teacher_models.geo.model_path" in message and str(tmp_path / "teacher") in message
    assert "learner.policy tiny" in message and f"({len(tok)} tokens)" in message
    TeacherStage(cfg, memory_bus())  # the other teacher, the student's tokenizer: starts


@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_the_learner_reports_each_teachers_figures_and_leaves_unserved_records_out_of_the_loss(micro_batch_size):
    """verl's ``distillation/loss`` and ``abs_loss`` by teacher: the token mean of the per-token
    loss over each teacher's records (whatever the micro-batches), checked against the loss
    computed by hand; a record no teacher serves adds nothing to the distillation loss (the
    same step without it gives the same per-teacher figures)."""
    import dataclasses

    import torch

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.trainer import Trainer

    def step(samples):
        cfg = LearnerConfig(policy="tiny", micro_batch_size=micro_batch_size, lr=0.0, grad_clip=0.0,
                            use_remove_padding="false")
        cfg.distillation = load_config(None, TWO).distillation
        cfg.distillation.distillation_loss.use_task_rewards = False
        return Trainer(cfg).step(samples)

    vocab = 260
    samples = distill_samples(vocab, 0, n=6)
    for i, s in enumerate(samples):
        s.teacher_name = ("math", "geo", "")[i % 3]
    unserved = [i for i, s in enumerate(samples) if not s.teacher_name]
    for i in unserved:
        samples[i] = dataclasses.replace(samples[i], teacher_logprobs=None)
    metrics = step(samples)
    model = Trainer(LearnerConfig(policy="tiny")).model  # the same init: lr 0 leaves it as it was
    for name in ("math", "geo"):
        mine = [s for s in samples if s.teacher_name == name]
        per_token = []
        for s in mine:  # k3 (verl's low_var_kl, clamped to [-10, 10]) over the student's log-probs
            student = torch.as_tensor(recompute_logprobs(model, s.prompt_ids, s.response_ids))
            diff = torch.as_tensor(s.teacher_logprobs) - student
            per_token.append(torch.clamp(torch.exp(diff) - diff - 1, -10, 10))
        by_hand = torch.cat(per_token)
        assert metrics[f"distillation/{name}/loss"] == pytest.approx(float(by_hand.mean()), rel=1e-4, abs=1e-6)
        assert metrics[f"distillation/{name}/abs_loss"] == pytest.approx(float(by_hand.abs().mean()), rel=1e-4,
                                                                         abs=1e-6)
    served_only = step([s for i, s in enumerate(samples) if i not in unserved])
    for key in ("distillation/math/loss", "distillation/geo/loss", "distillation/loss_min", "distillation/loss_max"):
        assert metrics[key] == pytest.approx(served_only[key], rel=1e-5, abs=1e-6), key


def test_each_teacher_asks_its_own_server_fleet_for_top_k():
    """Top-k from servers per teacher: teacher ``geo``'s entry sets the openai backend and its
    own fleet (a real HTTP server speaking vLLM's completions API with ``prompt_logprobs``),
    ``math`` stays a local model; geo's records carry its server's top-k, asked of it alone."""
    import asyncio

    from aiohttp import web

    from streamrl.testing import run_stage_async
    from tests.helpers import serve_app

    asked = []

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body["prompt_logprobs"])
        entries = [None] + [{str(t): {"logprob": -3.0, "rank": 4}, "7": {"logprob": -0.1, "rank": 1},
                             "8": {"logprob": -0.2, "rank": 2}, "9": {"logprob": -0.3, "rank": 3}}
                            for t in body["prompt"][1:]]
        return web.json_response({"choices": [{"text": "x", "prompt_logprobs": entries}]})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", healthy)
        runner, url = await serve_app(app)
        cfg = load_config(None, TWO + ["teacher.name=geo", "distillation.teacher_models.geo.backend=openai",
                                       f"distillation.teacher_models.geo.servers=[{url}/v1]",
                                       "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                       "distillation.distillation_loss.topk=3"])
        bus = memory_bus()
        cfg.bus = bus.config
        try:
            return await run_stage_async(TeacherStage(cfg, bus), [_rewarded(i) for i in range(6)],
                                         until={"distilled": 2})
        finally:
            await runner.cleanup()

    out = asyncio.run(main())
    assert sorted(d.id for d in out["distilled"]) == ["t1", "t4"] and set(asked) == {3} and len(asked) == 2
    for d in out["distilled"]:
        n = len(d.array("response_ids"))
        assert (d.teacher["name"], d.teacher["backend"], d.teacher_topk) == ("geo", "openai", 3)
        np.testing.assert_allclose(d.array("teacher_logprobs").reshape(n, 3), [[-0.1, -0.2, -0.3]] * n)
        assert d.array("teacher_ids").reshape(n, 3).tolist() == [[7, 8, 9]] * n


def test_the_status_line_and_summary_give_each_teachers_records_and_lag(tmp_path):
    """``distilled N (teacher lag L)`` per teacher (its group's lag), the records no teacher
    serves apart; the summary's ``distilled_by_teacher``; one teacher keeps the one part."""
    from collections import Counter

    from streamrl.supervisor.display import status_line, summarise
    from streamrl.supervisor.observer import Observation

    obs = Observation(teacher_input="rewarded", rewarded=9, distilled_ids={f"t{i}" for i in range(9)},
                      distilled_by=Counter({"math": 4, "geo": 3, "(none)": 2}), teacher_lags={"math": 0, "geo": 17})
    line = status_line(obs, 5)
    assert "| distilled math 4 (teacher lag 0) | distilled geo 3 (teacher lag 17) | undistilled (no teacher) 2 |" in line
    assert summarise(obs, tmp_path / "r.png")["distilled_by_teacher"] == {"(none)": 2, "geo": 3, "math": 4}
    one = Observation(teacher_input="rewarded", rewarded=5, distilled_ids={"a", "b"}, distilled_by=Counter(teacher=2))
    assert "| distilled 2 (teacher lag 3) |" in status_line(one, 5)
    assert "distilled_by_teacher" not in summarise(one, tmp_path / "r.png")


@pytest.mark.parametrize("loss_mode,agg", [("k3", "token-mean"), ("forward_kl_topk", "seq-mean-token-mean")])
def test_unserved_records_leave_the_distillation_figures_as_over_the_annotated_tokens(loss_mode, agg):
    """``teacher.unserved: train`` with a third of the records unserved: ``distillation/loss``,
    ``abs_loss`` (and top-k's ``teacher_mass`` / ``student_mass``) read as the same step without
    them (they were divided by every token: two-thirds of their value), while the term keeps
    verl's weight in the step, the mean over all the mini-batch's tokens (sequences for a
    sequence mean): each annotated token weighs what it weighs in verl."""
    import dataclasses

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.trainer import Trainer

    k = 4 if loss_mode == "forward_kl_topk" else 0

    def step(samples):
        cfg = LearnerConfig(policy="tiny", micro_batch_size=2, lr=0.0, grad_clip=0.0, loss_agg_mode=agg,
                            use_remove_padding="false")
        cfg.distillation = load_config(None, TWO).distillation
        cfg.distillation.distillation_loss.use_task_rewards = False  # the step's loss is the term alone
        cfg.distillation.distillation_loss.loss_mode = loss_mode
        cfg.distillation.distillation_loss.topk = k or None
        return Trainer(cfg).step(samples)

    samples = distill_samples(260, k, n=6)
    for i, s in enumerate(samples):
        s.teacher_name = ("math", "geo", "")[i % 3]
    samples = [dataclasses.replace(s, teacher_logprobs=None, teacher_ids=None) if not s.teacher_name else s
               for s in samples]
    served = [s for s in samples if s.teacher_name]
    mixed, alone = step(samples), step(served)
    figures = ["distillation/loss", "distillation/abs_loss"] + (
        ["distillation/teacher_mass", "distillation/student_mass"] if k else [])
    for key in figures:
        assert mixed[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
    if agg == "token-mean":
        share = sum(len(s.response_ids) for s in served) / sum(len(s.response_ids) for s in samples)
    else:
        share = len(served) / len(samples)
    assert 0 < share < 1
    assert mixed["loss"] == pytest.approx(alone["loss"] * share, rel=1e-5, abs=1e-7)
