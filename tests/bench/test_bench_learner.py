"""``streamrl bench learner`` against bare (issue 40): the bare loop is the same update as the
learner's (its loss equals the learner's on every step, padded and packed), and the summary
carries the ratios BENCHMARKS.md reports. Speed itself is the benchmark's business, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, last_json_line


def test_bench_learner_against_bare_trains_the_same_update(tmp_path):
    out = tmp_path / "learner.json"
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "bench", "learner", "--model", "tiny", "--sequences", "6",
         "--response-min", "4", "--response-max", "96", "--steps", "1", "--threads", "1",
         "--micro-batch-size", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary == json.loads(out.read_text())
    for path in ("padded", "packed"):
        r = summary["paths"][path]
        assert r["loss_rel_error"] <= 1e-5, (path, r)
        assert r["learner_over_bare"] > 0 and summary[f"learner_over_bare_{path}"] == r["learner_over_bare"]
    packed, padded = summary["paths"]["packed"], summary["paths"]["padded"]
    assert packed["forward_tokens_last_step"] < padded["forward_tokens_last_step"]  # no padding
    assert summary["learner_packed_over_padded"] > 0 and summary["bare_packed_over_padded"] > 0


def test_bench_learner_lora_reports_ratios_to_full_fine_tuning(tmp_path):
    """``--lora 0,8``: full fine-tuning and a rank-8 adapter on the same mini-batches, the
    ratios BENCHMARKS.md reports (the tiny model here: the ratios' goals are for >= 100M)."""
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "bench", "learner", "--lora", "8", "--model", "tiny", "--sequences", "4",
         "--prompt-tokens", "8", "--response-tokens", "16", "--threads", "1", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    full, lora = summary["ranks"]["0"], summary["ranks"]["8"]  # rank 0 (full) is always measured
    assert full["published_over_full"] == 1.0 and 0 < lora["published_over_full"] < 1
    assert 0 < summary["r8_optimizer_over_full"] < 1 and lora["trainable_m"] < full["trainable_m"]
    assert lora["optimizer_bytes"] == 2 * lora["gradient_bytes"]  # AdamW's two moments, adapters only
    assert summary["r8_step_over_full"] > 0


@pytest.mark.slow
def test_bench_learner_shapes_measures_the_default_runs_learner_and_rls(tmp_path):
    """``--shapes`` (issue 52): the default task's shape is configs/local.yaml's learner (its
    micro-batches, epochs, mini-batch of groups x group size) and digits' lengths; both shapes
    report packed against padded from the same mini-batches."""
    from streamrl.bench.learner_speed import SHAPES, shape_samples
    from streamrl.pipeline_config import load_config

    cfg = load_config("local.yaml")
    model, sequences, mbs, epochs, prompt, (lo, hi), _ = SHAPES["digits"]
    assert (model, mbs, epochs) == (cfg.learner.policy, cfg.learner.micro_batch_size, cfg.learner.ppo_epochs)
    assert sequences == cfg.learner.groups_per_mini_batch * cfg.feed.group_size
    assert hi == cfg.rollout.max_new_tokens and prompt == len("inc 48=")
    lengths = {len(s.response_ids) for s in shape_samples("digits", 0)}
    assert lengths == set(range(lo, hi + 1))
    out = tmp_path / "shapes.json"
    proc = subprocess.run([sys.executable, "-m", "streamrl", "bench", "learner", "--shapes", "--steps", "1",
                           "--threads", "1", "--clock", "cpu", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary == json.loads(out.read_text())
    for shape in SHAPES:
        r = summary["shapes"][shape]
        assert r["padded_step_s"] > 0 and r["packed_step_s"] > 0
        assert summary[f"{shape}_packed_over_padded"] == r["packed_over_padded"] > 0
