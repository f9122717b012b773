"""``streamrl bench learning``'s pieces (the whole bench runs minutes; BENCHMARKS.md has its
figures): the synchronous side on the real components for a few versions, the fixed latencies,
and the figures computed from reward curves."""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace

import pytest

from streamrl.bench import _sim, _stages, learning
from streamrl.cli import main
from tests.helpers import last_json_line


def setup(**kw):
    args = Namespace(quick=True, task="digits:rev", versions=3, seeds=1, staleness="", correction="", groups=2,
                     group_size=4, lr=0.0, entropy_coeff=0.0, lagged=False, target=0.5, final=2,
                     gen_latency=0.0, judge_latency=0.0, step_latency=0.0, recipes="")
    for k, v in kw.items():
        setattr(args, k.replace("-", "_"), v)
    return learning.setup_from(args)


def run(rewards, seen):
    return {"rewards": dict(enumerate(rewards)), "seen": dict(enumerate(seen))}


def test_time_and_samples_to_target_and_final_spread():
    s = setup(target=0.5, final=2)
    slow = run([0.1, 0.3, 0.6, 0.7], [1.0, 2.0, 3.0, 4.0])
    fast = run([0.1, 0.5, 0.4, 0.9], [0.5, 1.0, 1.5, 2.0])
    assert learning.reach(learning.curve(slow, s.batch), 0.5) == (3.0, 2 * s.batch)
    assert learning.reach(learning.curve(fast, s.batch), 0.5) == (1.0, 1 * s.batch)
    assert learning.reach(learning.curve(slow, s.batch), 0.95) == (None, None)
    t = learning.summarise([slow, fast], s)
    assert t["final_by_seed"] == [0.65, 0.65] and t["final_min"] == t["final_max"] == 0.65
    assert t["seconds_to_target"] == 2.0 and t["samples_to_target"] == round(1.5 * s.batch)
    assert t["reached"] == "2/2"
    never = learning.summarise([slow, run([0.1, 0.2, 0.2, 0.2], [1, 2, 3, 4])], s)
    assert never["seconds_to_target"] is None and never["reached"] == "1/2"


def test_quick_defaults_are_small():
    s = setup(versions=0, seeds=0, groups=16, group_size=16, target=0.0, final=5)
    assert s.seeds == 1 and s.staleness == [1] and s.corrections == [True] and s.versions <= 30 and 0 < s.target < 1
    full = setup(quick=False, versions=0, seeds=0, target=0.0)
    assert full.staleness == [1, 2, 4] and full.corrections == [False, True] and full.seeds == 3
    with pytest.raises(SystemExit, match="--correction"):
        setup(correction="maybe")
    with pytest.raises(SystemExit, match="--entropy-coeff"):
        setup(entropy_coeff=-0.1)


def test_recipes_set_the_learner_keys_their_verl_configs_set(tmp_path):
    """Issue 37: ``--recipes`` streams each recipe once; each sets its keys on the learner and
    nothing else (Dr. GRPO's constant is the longest response)."""
    s = setup(recipes="dapo,drgrpo,gspo,rloo")
    assert s.recipes == ["dapo", "drgrpo", "gspo", "rloo"]
    with pytest.raises(SystemExit, match="--recipes"):
        setup(recipes="dapo,ppo2")
    base = learning.run_config(s, "127.0.0.1:1", tmp_path / "r", "tiny", 0, 1, False).learner
    got = {r: learning.run_config(s, "127.0.0.1:1", tmp_path / r, "tiny", 0, 1, False, r).learner for r in s.recipes}
    assert got["dapo"].filter_groups.enable and got["dapo"].clip_ratio_high == 0.28 and not base.filter_groups.enable
    assert not got["drgrpo"].norm_adv_by_std_in_grpo and got["drgrpo"].loss_agg_mode == "seq-mean-token-sum-norm"
    assert got["drgrpo"].loss_scale_factor > 0
    assert got["gspo"].policy_loss.loss_mode == "gspo" and base.policy_loss.loss_mode == "vanilla"
    assert got["rloo"].adv_estimator == "rloo" and got["rloo"].lr == base.lr
    for learner in got.values():
        learner.validate()


def test_issue_48_recipes_ppo_remax_and_rollout_corrected_grpo(tmp_path):
    """PPO trains a critic (gae), ReMax's workers add a greedy baseline per group (the gate
    counts it), and the rollout-corrected GRPO uses verl's correction in place of AReaL's."""
    s = setup(recipes="grpo,ppo,remax,grpo_rc")
    cfgs = {r: learning.run_config(s, "127.0.0.1:1", tmp_path / r, "tiny", 0, 1, True, r) for r in s.recipes}
    assert cfgs["ppo"].learner.adv_estimator == "gae" and cfgs["ppo"].learner.critic.lr > 0
    assert cfgs["remax"].rollout.greedy_baseline and not cfgs["grpo"].rollout.greedy_baseline
    assert cfgs["remax"].rollout.trajectories_per_version == s.groups * (s.group_size + 1)
    rc = cfgs["grpo_rc"].learner
    assert rc.rollout_correction.rollout_is == "token" and not rc.decoupled and cfgs["grpo"].learner.decoupled
    for c in cfgs.values():
        c.learner.validate()
    runs = {"sync": [run([0.1, 0.2, 0.3], [1.0, 2.0, 3.0])], "recipe grpo": [run([0.1, 0.3, 0.6], [1.0, 3.0, 5.0])],
            "recipe ppo": [run([0.1, 0.4, 0.7], [1.0, 4.0, 7.0])]}
    summary = learning.LearningBench.summary(Namespace(s=s), runs)
    assert summary["cost_vs_grpo_ppo"] == 1.4  # 3.5 s a version against 2.5
    t = summary["variants"]["recipe grpo"]
    assert t["seconds_per_version"] == 2.5


def test_sync_pays_the_latencies_with_the_stages_concurrency():
    async def calls(limit, n, latency_s):
        started = time.monotonic()
        out = await _stages.bounded(limit, [asyncio.sleep(latency_s, result=i) for i in range(n)])
        return out, time.monotonic() - started

    out, took = asyncio.run(calls(4, 8, 0.1))
    assert out == list(range(8)) and 0.2 <= took < 0.35  # two waves of four, not one of eight


def test_latencies_add_to_the_real_work():
    started = time.monotonic()
    out = asyncio.run(_sim.score_after("digits", "594", "593", latency_s=0.05))
    assert out["score"] == pytest.approx(2 / 3) and time.monotonic() - started >= 0.05

    class Trainer:
        model = "m"

        def step(self, samples):
            return {"sequences": float(len(samples))}

    wrapped = _sim.TimedTrainer(Trainer(), 0.05)
    started = time.monotonic()
    assert wrapped.step([1, 2]) == {"sequences": 2.0} and wrapped.model == "m"
    assert time.monotonic() - started >= 0.05


def test_the_synchronous_side_trains_on_the_real_components(tmp_path):
    from streamrl.feed.prompts import build_prompts
    from streamrl.tasks import digits

    s = setup(versions=3, groups=2, group_size=4)
    policy = str(digits.warm_start(tmp_path / "warm", steps=30))
    cfg = learning.run_config(s, "unused:9092", tmp_path / "sync", policy, seed=0, staleness=1, correction=False)
    prompts = list(build_prompts(cfg.feed))
    out = asyncio.run(learning.run_sync(s, cfg, prompts))
    assert sorted(out["rewards"]) == [0, 1, 2] and all(0.0 <= r <= 1.0 for r in out["rewards"].values())
    seen = [out["seen"][v] for v in range(3)]
    assert seen == sorted(seen) and seen[0] >= 0.0
    assert sorted(p.name for p in (tmp_path / "sync" / "weights").iterdir()) == ["v1", "v2", "v3"]
    assert out["generated_by"] == {0: 0, 1: 1, 2: 2}  # on-policy: each batch by the newest weights


def test_the_lagged_variant_generates_each_batch_with_weights_k_versions_old(tmp_path):
    from streamrl.feed.prompts import build_prompts
    from streamrl.tasks import digits

    s = setup(versions=5, groups=2, group_size=4)
    policy = str(digits.warm_start(tmp_path / "warm", steps=30))
    cfg = learning.run_config(s, "unused:9092", tmp_path / "lagged", policy, seed=0, staleness=2, correction=True)
    out = asyncio.run(learning.run_sync(s, cfg, list(build_prompts(cfg.feed)), lag=2))
    assert out["generated_by"] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 2}


@pytest.mark.e2e
def test_the_bench_trains_both_sides_and_prints_its_figures(bootstrap, tmp_path, capsys):
    """The whole command, tiny: the synchronous side, the real stages at staleness 1 with the
    correction and its in-process lagged twin, every version trained, one JSON line and a plot."""
    rc = main(["bench", "learning", "--bootstrap-servers", bootstrap, "--quick", "--versions", "3",
               "--groups", "2", "--group-size", "4", "--gen-latency", "0.02", "--judge-latency", "0.01",
               "--step-latency", "0.02", "--target", "0.01", "--final", "2", "--lagged", "--out", str(tmp_path)])
    assert rc == 0
    res = last_json_line(capsys.readouterr().out)
    assert set(res["variants"]) == {"sync", "staleness 1 + correction", "lagged 1 + correction"}
    for name, v in res["variants"].items():
        assert 0.0 <= v["final_min"] <= v["final_reward"] <= v["final_max"] <= 1.0, name
        if name.startswith("lagged"):  # no latencies paid: no clock
            assert v["seconds"] is None and v["seconds_to_target"] is None
        else:
            assert v["seconds"] > 0, name
    assert res["setup"]["task"] == "digits:rev" and res["setup"]["corrections"] == [True]
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_distill_sets_rl_alone_against_a_teacher_with_and_without_task_rewards(tmp_path):
    """``--distill``: the synchronous run (whose final policy is the teacher), RL alone streamed,
    and the same streamed with the teacher stage, with and without task rewards."""
    s = setup(distill=True)
    assert list(learning.variants(s)) == ["sync", "staleness 1 + correction", "distill + task rewards",
                                          "distill alone"]
    for task_rewards in (True, False):
        cfg = learning.run_config(s, "127.0.0.1:9", tmp_path, "tiny", 0, 1, True, teacher="/teacher",
                                  task_rewards=task_rewards)
        assert cfg.distillation.enabled and cfg.teacher.model == "/teacher"
        assert cfg.distillation.distillation_loss.use_task_rewards is task_rewards
        cfg.distillation.validate(), cfg.teacher.validate()
    assert not learning.run_config(s, "127.0.0.1:9", tmp_path, "tiny", 0, 1, True).distillation.enabled


def test_the_rule_built_digits_teacher_knows_the_answer(tmp_path):
    """``_sim.serve_digits_teacher``: vLLM's ``prompt_logprobs`` for "rev 48=" + a response: the
    right answer's tokens (and end-of-sequence) likely, a wrong one not; through the teacher
    stage's own parser."""
    import aiohttp
    import numpy as np

    from streamrl.distillation.teacher import parse_prompt_logprobs
    from streamrl.policy import load_policy
    from streamrl.weights import save_policy

    _, tok = load_policy("tiny")
    save_policy(_, tok, tmp_path / "tok")
    prompt = tok("rev 48=", add_special_tokens=False)["input_ids"]

    async def ask(url: str, response: list[int], k: int = 0):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": prompt + response, "prompt_logprobs": k}) as r:
                entries = (await r.json())["choices"][0]["prompt_logprobs"]
        out = parse_prompt_logprobs(entries, np.array(prompt), np.array(response), k)
        return out if k else out.logprobs

    with _sim.SimServer(_sim.serve_digits_teacher, str(tmp_path / "tok")) as srv:
        good = tok("84", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        bad = tok("48", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        right, wrong = asyncio.run(ask(srv.url, good)), asyncio.run(ask(srv.url, bad))
        top = asyncio.run(ask(srv.url, bad, 4))  # forward_kl_topk: the right token ranks first
    assert top.ids[:, 0].tolist() == good and np.allclose(top.logprobs[:, 0], np.log(0.97), atol=1e-6)
    assert np.allclose(right, np.log(0.97), atol=1e-6)
    assert (wrong[:2] < np.log(0.01)).all() and np.isclose(wrong[2], np.log(0.97))


def test_on_update_compares_the_workers_modes_costed_per_decoding_step(tmp_path):
    """Issue 50: ``--on-update drain,partial`` streams each ``rollout.on_update`` (partial:
    ``--chunk-tokens`` a chunk) beside the synchronous loop; generation is costed per decoding
    step inside the engine (``--token-latency``, 0.3 by default), not per call."""
    s = setup(on_update="drain,partial", gen_latency=None)
    assert s.on_update == ["drain", "partial"] and s.token_latency_s == 0.3 and s.gen_latency_s == 0.0
    assert list(learning.variants(s)) == ["sync", "on_update drain", "on_update partial"]
    assert learning.variants(s)["on_update partial"].on_update == "partial"
    cfg = learning.run_config(s, "127.0.0.1:9", tmp_path, "tiny", 0, 1, True, on_update="partial")
    assert cfg.rollout.on_update == "partial" and cfg.rollout.partial_chunk_tokens == 1
    cfg.rollout.validate()
    assert learning.costs(s).token_latency_s == 0.3
    assert setup(gen_latency=None).gen_latency_s == 1.0 and setup().token_latency_s == 0.0
    with pytest.raises(SystemExit, match="--on-update"):
        setup(on_update="drain,abort")  # abort is the servers' way; the local engine drains
    with pytest.raises(SystemExit, match="--chunk-tokens"):
        setup(on_update="partial", chunk_tokens=0)


def test_the_token_latency_is_paid_inside_the_engine_per_decoding_step():
    """A generation of k tokens keeps the engine busy ``k`` steps longer than its real work:
    a weight load (which waits for the engine) waits for it too."""
    from streamrl.rollout.backends import SamplingParams
    from streamrl.rollout.config import RolloutConfig

    backend = _sim.latency_backend(RolloutConfig(), 0.0, token_latency_s=0.1)

    async def go():
        started = time.monotonic()
        (samples,) = await backend.generate(["rev 12="], 1, SamplingParams(max_new_tokens=3, temperature=0.0))
        return len(samples[0].response_ids), time.monotonic() - started

    steps, took = asyncio.run(go())
    assert 1 <= steps <= 3 and took >= 0.1 * steps


@pytest.mark.e2e
@pytest.mark.timeout(600)  # three runs, two of them five stage processes: ~2 min alone, past 5 beside other runs on 2 cores
def test_the_on_update_comparison_runs_both_modes(bootstrap, tmp_path, capsys):
    """The whole command, tiny: sync, drain and partial streamed, one JSON line with each mode's
    final reward, time to target and share of trajectories spanning versions (none under drain)."""
    rc = main(["bench", "learning", "--bootstrap-servers", bootstrap, "--quick", "--on-update", "drain,partial",
               "--versions", "3", "--groups", "2", "--group-size", "4", "--token-latency", "0.02",
               "--judge-latency", "0.01", "--step-latency", "0.02", "--target", "0.01", "--final", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    res = last_json_line(capsys.readouterr().out)
    assert set(res["variants"]) == {"sync", "on_update drain", "on_update partial"}
    for name in ("on_update drain", "on_update partial"):
        v = res["variants"][name]
        assert 0.0 <= v["final_min"] <= v["final_reward"] <= v["final_max"] <= 1.0 and v["seconds"] > 0, name
        assert 0.0 <= v["spanning_fraction"] <= 1.0
    assert res["variants"]["on_update drain"]["spanning_fraction"] == 0.0
    assert res["variants"]["on_update drain"]["span_max"] == 1
    assert "final_reward_partial_minus_drain" in res and res["setup"]["on_update"] == ["drain", "partial"]
