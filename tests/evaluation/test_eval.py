"""Validation (``streamrl.evaluation``): verl's figures computed as verl computes them (checked
against verl's own ``process_validation_metrics``), named as verl's trackers name them, and the
eval stage's logic on the in-memory transport: which versions it evaluates, once each, with
figures an independent generation and scoring reproduces."""

from __future__ import annotations

import ast
import importlib.util
import random
import re
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from streamrl.evaluation.config import EvalConfig
from streamrl.evaluation.scores import response_figures, tracker_names, validation_metrics
from streamrl.records import EvalResult, PolicyVersion


def verl_function():
    """verl's ``process_validation_metrics`` (and the two helpers it calls), compiled from the
    installed verl's file (importing verl needs Ray and torch's whole stack: the Makefile
    installs it without its dependencies)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (`pip install --no-deps verl`, as the Makefile does)")
    path = Path(spec.submodule_search_locations[0]) / "trainer" / "ppo" / "metric_utils.py"
    tree = ast.parse(path.read_text())
    wanted = {"bootstrap_metric", "calc_maj_val", "process_validation_metrics"}
    module = ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    namespace = {"np": np, "defaultdict": defaultdict, "partial": partial, "Any": object, "Callable": object}
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - verl's own source, from its wheel
    return namespace["process_validation_metrics"]


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_figures_equal_verls_own_on_random_responses(n):
    verl = verl_function()
    rng = random.Random(n)
    sources, uids, infos = [], [], defaultdict(list)
    for p in range(12):
        ds = rng.choice(["gsm8k", "math"])
        for _ in range(n):
            sources.append(ds)
            uids.append(f"p{p}")
            acc = rng.random() < 0.4
            infos["reward"].append(float(acc) - 0.1 * rng.random())
            infos["acc"].append(acc)
            infos["pred"].append(rng.choice(["1", "2", "3"]))
    ours = validation_metrics(sources, uids, dict(infos), seed=42)
    theirs = verl(sources, uids, dict(infos), seed=42)
    assert set(ours) == set(theirs)
    for ds in theirs:
        assert set(ours[ds]) == set(theirs[ds]) == {"reward", "acc"}  # pred is the vote, not a figure
        for var in theirs[ds]:
            assert ours[ds][var].keys() == theirs[ds][var].keys()
            for fig, value in theirs[ds][var].items():
                assert ours[ds][var][fig] == pytest.approx(value, abs=1e-12), (ds, var, fig)
    if n > 1:
        assert any(k.startswith("maj@") for k in ours["gsm8k"]["acc"])


def test_tracker_names_put_the_core_figures_under_val_core_as_verl():
    metrics = {"reward/mean@4": 0.5, "reward/std@4": 0.1, "acc/mean@4": 0.6, "acc/best@2/mean": 0.7,
               "acc/best@4/mean": 0.8, "acc/best@4/std": 0.05, "acc/maj@4/mean": 0.65, "acc/worst@4/mean": 0.2}
    names = tracker_names("gsm8k", metrics, core="acc")
    core = {k for k in names if k.startswith("val-core/")}
    assert core == {"val-core/gsm8k/acc/mean@4", "val-core/gsm8k/acc/best@4/mean", "val-core/gsm8k/acc/best@4/std",
                    "val-core/gsm8k/acc/maj@4/mean"}
    assert names["val-aux/gsm8k/reward/mean@4"] == 0.5 and "val-aux/gsm8k/acc/best@2/mean" in names


def test_response_figures_take_the_scorers_fields_and_leave_others_out():
    rows = [("gsm8k", "p0", 1.0, {"acc": True, "pred": "4", "detail": {"x": 1}}),
            ("gsm8k", "p0", 0.0, {"acc": False, "pred": "5", "detail": {"x": 2}}),
            ("gsm8k", "p1", 1.0, {"acc": True, "pred": "7", "detail": {}})]
    figures = response_figures(rows, seed=1)["gsm8k"]
    assert figures["reward/mean@2"] == pytest.approx(0.5) and figures["reward/mean@1"] == 1.0
    assert figures["acc/mean@2"] == pytest.approx(0.5) and not any(k.startswith(("pred/", "detail/")) for k in figures)


def test_asked_versions():
    cfg = EvalConfig(dataset="x", every=3)
    assert [v for v in range(10) if cfg.asks(v, final=v == 9)] == [0, 3, 6, 9]
    assert not EvalConfig(dataset="x", every=0, before_train=False).asks(0, False)
    assert EvalConfig(dataset="x", every=0).asks(7, True)


# -- the stage, on the in-memory transport --------------------------------------------------------

@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """The tiny policy's weights, as the learner writes a version."""
    from streamrl.policy import load_policy
    from streamrl.weights import save_policy

    model, tok = load_policy("tiny", seed=3)
    return save_policy(model, tok, tmp_path_factory.mktemp("weights") / "v0")


def eval_config(weights: Path, **fields):
    from streamrl.pipeline_config import load_config

    cfg = load_config("local.yaml", [f"learner.weights_dir={weights.parent}", "eval.dataset=digits@1",
                                     "eval.limit=6", *[f"eval.{k}={v}" for k, v in fields.items()]])
    return cfg


def versions(weights: Path, last: int) -> list[PolicyVersion]:
    return [PolicyVersion(version=v, weights_uri=str(weights), metrics={"pg_loss": 0.0}, lineage="l",
                          final=v == last) for v in range(last + 1)]


def test_the_stage_evaluates_each_asked_version_once_with_an_independent_figure(weights):
    from streamrl.evaluation.stage import Evaluator
    from streamrl.testing import memory_bus, run_stage

    bus = memory_bus()
    cfg = eval_config(weights, every=2)
    cfg.bus = bus.config
    first = Evaluator.from_config(cfg, bus)
    out = run_stage(first, versions(weights, 5)[:3], until={"eval": 1})  # stopped after version 0
    assert out["eval"][0].version == 0
    # a new member of the group (a restart): it goes on from the committed record and never
    # publishes a version again, whatever it reads twice
    second = Evaluator.from_config(cfg, bus)
    out2 = run_stage(second, versions(weights, 5)[3:], until=None, timeout_s=120)
    results = [*out["eval"], *out2["eval"]]
    assert sorted(r.version for r in results) == [0, 2, 4, 5]  # 0, every 2nd, and the last
    assert all(isinstance(r, EvalResult) and r.data_source == "digits" and r.n == 1 and r.prompts == 6
               for r in results)
    # the same figure, computed here: greedy generation from the same weights, scored by the
    # digits rule directly
    import torch

    from streamrl.policy import load_policy
    from streamrl.scorers.digits import compute_score
    from streamrl.tasks import task_rows

    model, tok = load_policy(str(weights))
    rewards = []
    for row in task_rows("digits@1", limit=6):
        ids = tok(row["question"], add_special_tokens=True, return_tensors="pt").input_ids
        with torch.no_grad():
            new = model.generate(ids, do_sample=False, max_new_tokens=cfg.rollout.max_new_tokens,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        score = compute_score("digits", tok.decode(new, skip_special_tokens=True), row["answer"])
        rewards.append(score["score"] if isinstance(score, dict) else score)
    for r in results:
        assert r.metrics["reward/mean@1"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)


def test_skip_stale_evaluates_only_the_newest_of_what_waits(weights):
    from streamrl.evaluation.stage import Evaluator
    from streamrl.testing import run_stage

    late = run_stage(Evaluator, versions(weights, 6), config=eval_config(weights, every=2), until=None, timeout_s=120)
    skipping = run_stage(Evaluator, versions(weights, 6), config=eval_config(weights, every=2, skip_stale="true"),
                         until=None, timeout_s=120)
    assert [r.version for r in late["eval"]] == [0, 2, 4, 6]  # each asked one, late
    assert [r.version for r in skipping["eval"]] == [6]  # every asked one was overtaken by the last


# -- config ---------------------------------------------------------------------------------------

def test_verls_validation_and_tracker_keys_in_a_file_map_onto_eval_and_tracking(tmp_path):
    from streamrl.packaged import resolve_config
    from streamrl.pipeline_config import load_config

    verl = tmp_path / "verl.yaml"
    verl.write_text(resolve_config("local.yaml").read_text() + """
data:
  val_files: [digits@1]
trainer:
  test_freq: -1
  val_before_train: false
  logger: console
  project_name: p
  experiment_name: e
actor_rollout_ref:
  rollout:
    val_kwargs: {n: 4, do_sample: true, temperature: 0.7, top_p: 0.9}
""")
    cfg = load_config(verl)
    assert (cfg.eval.dataset, cfg.eval.every, cfg.eval.before_train) == ("digits@1", 0, False)
    assert (cfg.eval.n, cfg.eval.do_sample, cfg.eval.temperature, cfg.eval.top_p) == (4, True, 0.7, 0.9)
    assert (cfg.tracking.loggers, cfg.tracking.project, cfg.tracking.experiment) == (["console"], "p", "e")


@pytest.mark.parametrize("override, field", [
    ("tracking.loggers=[console,neptune]", "tracking.loggers"),
    ("trainer.n_gpu_per_node=8", "trainer.n_gpu_per_node=8"),  # a verl key misspelt: named as typed
    ("eval.n=0", "eval.n"),
    ("data.val_files=[]", "data.val_files=[]"),
])
def test_a_bad_key_fails_at_start_naming_it(override, field):
    from streamrl.errors import ConfigError
    from streamrl.pipeline_config import load_config

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config("local.yaml", [override])
