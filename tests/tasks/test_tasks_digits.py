"""The generated default task (streamrl.tasks.digits) and its scorer (streamrl.scorers.digits):
rows a pure function of the spec, partial credit exact, malformed answers 0 and never an
exception, and the rows reaching the feed as local.yaml reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.pipeline_config import load_config
from streamrl.datasets import read_rows
from streamrl.errors import ConfigError
from streamrl.feed.prompts import build_prompts
from streamrl.scorers import ScoreError, default_compute_score
from streamrl.scorers.digits import compute_score, partial_credit
from streamrl.tasks import digits

ROOT = Path(__file__).resolve().parents[2]


def test_rows_are_a_pure_function_of_the_spec():
    a, b = digits.generate("digits", 200), digits.generate("digits", 200)
    assert a == b and len(a) == 200
    assert digits.generate("digits@1", 200) != a  # another seed, other rows
    assert digits.generate("digits", 50) == a[:50]  # a smaller limit is a prefix
    row = a[0]
    assert row["question"] == f"inc {row['extra_info']['digits']}=" and row["data_source"] == "digits"
    assert all(len(r["answer"]) == digits.DIGITS == 2 and r["answer"].isdigit() for r in a)


@pytest.mark.parametrize("op, given, answer", [("inc", "489", "590"), ("inc", "999", "000"),
                                               ("copy", "071", "071"), ("rev", "071", "170"),
                                               ("sort", "907", "079")])
def test_operations(op, given, answer):
    assert digits.OPS[op](given) == answer
    rows = digits.generate(f"digits:{op}@3", 20)
    assert all(r["answer"] == digits.OPS[op](r["extra_info"]["digits"]) for r in rows)


def test_a_bad_spec_names_the_field():
    with pytest.raises(ConfigError, match="feed.dataset.*inc, copy, rev, sort"):
        read_rows("digits:mul")
    with pytest.raises(ConfigError, match="seed"):
        read_rows("digits@x")


@pytest.mark.parametrize("response, score", [
    ("593", 1.0), (" 593\n", 1.0), ("594", 2 / 3), ("493", 2 / 3), ("000", 0.0),
    ("59", 2 / 3), ("5", 1 / 3), ("5930", 3 / 4), ("59301", 3 / 5), ("395", 1 / 3)])
def test_partial_credit_is_exact(response, score):
    assert compute_score("digits", response, "593")["score"] == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("response", ["", "   ", "abc", "59a", "5 93", "-593", "+593", "59.3", "５９３",
                                      "593<eos>", "\x00593", None, 593, b"593", ["593"]])
def test_malformed_answers_score_zero_and_never_raise(response):
    out = compute_score("digits", response, "593")
    assert out == {"score": 0.0, "pred": None}
    assert partial_credit(response, "593") == 0.0


def test_routed_as_a_built_in_rule_and_a_missing_answer_is_an_error():
    out = default_compute_score("digits", "594", "593")
    assert out["score"] == pytest.approx(2 / 3) and out["pred"] == "594"
    with pytest.raises(ScoreError) as err:
        compute_score("digits", "593", None)
    assert err.value.reason == "no_ground_truth"


def test_the_default_config_feeds_the_task_with_its_answers():
    cfg = load_config(ROOT / "configs" / "local.yaml")
    cfg.feed.limit, cfg.feed.shuffle = 5, False
    prompts = list(build_prompts(cfg.feed))
    rows = read_rows("digits", 5)
    assert [p.prompt for p in prompts] == [r["question"] for r in rows]  # plain text, as written
    assert [p.ground_truth for p in prompts] == [r["answer"] for r in rows]
    assert {p.data_source for p in prompts} == {"digits"} and prompts[0].group_size == cfg.feed.group_size


def test_warm_start_writes_a_loadable_policy_and_reuses_it(tmp_path):
    from streamrl.policy import load_policy

    path = digits.warm_start(tmp_path / "w", steps=2, batch=4)
    model, tok = load_policy(str(path))
    assert tok.decode(tok("inc 123=").input_ids) == "inc 123="
    stamp = (path / "config.json").stat().st_mtime_ns
    assert digits.warm_start(tmp_path / "w", steps=2, batch=4) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # built once per run directory
