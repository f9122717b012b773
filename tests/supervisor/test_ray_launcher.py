"""`streamrl run --launcher ray` places stages as Ray actors: the main job with the default
resources on a 2-CPU machine, to its end; a local Ray with CPU workers running real reward-stage
processes, grown and shrunk by the autoscaler; the checks before anything starts (what each stage
asks for against the cluster, the variables passed by name), one line each. The two-node cluster
is tests/supervisor/test_ray_cluster.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from streamrl.bus import Bus
from streamrl.pipeline_config import load_config
from streamrl.errors import ConfigError
from streamrl.supervisor.ray_launcher import RayLauncher, _localise
from streamrl.supervisor.placement import actor_options, check_placement, stage_counts, stage_env, stage_resources
from streamrl.records import Rewarded
from streamrl.supervisor.autoscale import LagAutoscaler, resize_reward_group
from streamrl.supervisor.observer import Observer
from tests.helpers import last_json_line, read_topic, trajectory

SLOW_SCORER = '''
import asyncio
async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.05)  # a slow remote scorer: each member does ~40 records/s
    return 1.0
'''


@pytest.mark.e2e
def test_ray_launcher_runs_the_reward_group_and_autoscales_it(bus_config, tmp_path: Path):
    (tmp_path / "slow.py").write_text(SLOW_SCORER)
    config = tmp_path / "reward.yaml"
    config.write_text(
        "reward:\n"
        "  max_in_flight: 2\n"
        "  scorers:\n"
        f"    slow: {{type: function, path: '{tmp_path / 'slow.py'}:compute_score', data_sources: [slow]}}\n")
    argv = ["reward", "--bootstrap-servers", bus_config.bootstrap_servers, "--config", str(config),
            f"bus.topic_prefix={bus_config.topic_prefix}", "bus.commit_interval_s=0.2", "metrics.port=0"]
    bus = Bus(bus_config)
    n = 600
    launcher = RayLauncher(tmp_path / "logs", num_cpus=4)
    scaler = LagAutoscaler(min_members=1, max_members=2, scale_up_lag=50, scale_down_lag=0,
                           window_s=2.0, cooldown_s=4.0)
    sizes: list[int] = []
    counter = iter(range(100))

    def start_reward() -> None:
        launcher.start(f"reward-{next(counter)}", argv, "reward")

    async def main() -> list:
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(trajectory(full=True, id=f"t{i}", group_id=f"g{i}", data_source="slow"))
                                   for i in range(n)])
        observer = Observer(bus, reward_group=bus.config.group("reward"))
        await observer.start()
        start_reward()
        deadline = time.monotonic() + 150
        try:
            while time.monotonic() < deadline:
                await observer.poll(timeout_ms=500)
                await resize_reward_group(observer, launcher, scaler, start_reward, time.monotonic(),
                                          show=lambda line: None)
                live = [x for x in launcher.names() if x.startswith("reward-") and launcher.returncode(x) is None]
                sizes.append(len(live))
                if max(sizes) == 2 and sizes[-1] == 1 and await observer.reward_lag() == 0:
                    break
        finally:
            await observer.stop()
        return await read_topic(bus, "rewarded", n, timeout_s=30)

    try:
        out = asyncio.run(main())
    finally:
        launcher.stop_all()
        ray.shutdown()
    assert max(sizes) == 2, "the autoscaler never added a member while lag grew"
    assert sizes[-1] == 1, "the autoscaler did not remove the member once the lag was gone"
    assert {Rewarded.decode(m.value).id for m in out} == {f"t{i}" for i in range(n)}  # nothing lost


ROOT = Path(__file__).resolve().parents[2]


def ray_run(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None,
            pin_two_cpus: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("STREAMRL_BOOTSTRAP_SERVERS", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "streamrl", "run", "--launcher", "ray", f"run.out_dir={tmp_path}", *overrides]
    if pin_two_cpus:
        cmd = ["taskset", "-c", "0,1", *cmd]
    return subprocess.run(cmd, cwd=ROOT, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
@pytest.mark.e2e
def test_run_with_default_resources_goes_to_its_end_on_two_cpus(tmp_path):
    """No run.ray.num_cpus, no resources given: learner 1 CPU, rollout 1, two reward members and
    the feed 0.25 each, on a machine with 2 CPUs (pinned to two with taskset where there are more)."""
    pin = shutil.which("taskset") is not None
    proc = ray_run(tmp_path, "learner.versions=2", "feed.limit=200", pin_two_cpus=pin, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["ended"] == "done" and summary["versions"] == 2 and summary["launcher"] == "ray"
    assert summary["restarts"] == 0 and summary["records"]["trained"] > 0
    if pin:
        assert "ray: a local Ray with 3 logical CPUs for the stages' 2.75 (this machine has 2 cores" in proc.stderr
    logs = Path(summary["out"]) / "logs"
    assert sorted(p.name for p in logs.glob("*.log")) == ["feed.log", "learner.log", "reward-0.log", "reward-1.log",
                                                          "rollout-0.log"]


@pytest.mark.e2e
def test_a_gpu_the_cluster_lacks_is_one_line_naming_the_stage(tmp_path):
    proc = ray_run(tmp_path, "run.ray.resources.learner.num_gpus=1", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "embedded broker:" not in proc.stderr  # nothing started
    assert proc.stderr.strip().splitlines()[-1] == (
        "streamrl run: stage 'learner' asks for 1 GPU; the cluster has none (run.ray.resources.learner.num_gpus)")


# -- the checks themselves, without a Ray ---------------------------------------------------------
NODE = {"CPU": 2.0, "memory": 8.0 * 2 ** 30}


def asks_for(*overrides: str) -> tuple[dict, dict]:
    cfg = load_config("local.yaml", overrides)
    return stage_resources(cfg), stage_counts(cfg)


def test_default_asks_and_what_overrides_change():
    asks, counts = asks_for()
    assert asks == {"learner": {"num_cpus": 1.0}, "reward": {"num_cpus": 0.25}, "teacher": {"num_cpus": 1.0},
                    "rollout": {"num_cpus": 1.0}, "feed": {"num_cpus": 0.25}}
    assert counts == {"learner": 1, "reward": 2, "teacher": 0, "rollout": 1, "feed": 1}
    # distillation (issue 59): every teacher group's members are placed, each group its own size
    two = ["distillation.enabled=true", "run.teacher_members=2",
           "+distillation.teacher_models.math.key=openai/gsm8k", "+distillation.teacher_models.math.model_path=tiny",
           "+distillation.teacher_models.geo.key=geo", "+distillation.teacher_models.geo.model_path=tiny",
           "distillation.teacher_models.geo.members=3"]
    assert asks_for(*two)[1]["teacher"] == 2 + 3
    assert asks_for(*two, "run.teacher_autoscale.max_members=4")[1]["teacher"] == 4 + 4  # each may grow that far
    assert asks_for("distillation.enabled=true")[1]["teacher"] == 1
    alone = asks_for("distillation.enabled=true", "distillation.distillation_loss.use_task_rewards=false",
                     "teacher.backend=openai", "teacher.servers=[http://t:1/v1]")
    assert alone[1]["reward"] == 0 and alone[0]["teacher"] == {"num_cpus": 0.25}  # no reward group; a server fleet
    assert asks_for("rollout.backend=openai")[0]["rollout"] == {"num_cpus": 0.25}  # waits on a server
    assert asks_for("run.autoscale.max_members=5")[1]["reward"] == 5  # the group may grow that far
    asks, _ = asks_for("run.ray.resources.learner.num_gpus=1", "run.ray.resources.learner.memory_gb=2",
                       "run.ray.resources.rollout.gen=1")
    assert actor_options(asks["learner"]) == {"num_cpus": 1.0, "num_gpus": 1.0, "memory": 2 * 2 ** 30}
    assert actor_options(asks["rollout"]) == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"gen": 1.0}}
    with pytest.raises(ConfigError, match=r"'run.ray.resources.judge': not a stage"):
        asks_for("run.ray.resources.judge.num_cpus=1")
    with pytest.raises(ConfigError, match=r"'run.ray.resources.feed.num_cpus': must be >= 0"):
        asks_for("run.ray.resources.feed.num_cpus=-1")


def test_placement_names_the_stage_that_does_not_fit_and_why():
    asks, counts = asks_for()
    assert check_placement(asks, counts, [NODE, NODE]) is None
    assert check_placement(asks, counts, [NODE]) == (  # 2.75 CPUs on one 2-CPU node
        "stage 'rollout-0' cannot be placed: the stages before it (learner, reward-0, reward-1) take 1.5 CPUs of the "
        "cluster's 2 CPUs, and it asks for 1 CPU (run.ray.resources.rollout.num_cpus, or a bigger cluster)")
    assert check_placement(*asks_for("run.ray.resources.learner.num_gpus=1"), [NODE, NODE]) == (
        "stage 'learner' asks for 1 GPU; the cluster has none (run.ray.resources.learner.num_gpus)")
    assert check_placement(*asks_for("run.ray.resources.rollout.num_gpus=2"), [NODE, {**NODE, "GPU": 1.0}]) == (
        "stage 'rollout' asks for 2 GPUs; the largest node has 1 GPU (run.ray.resources.rollout.num_gpus)")
    assert check_placement(*asks_for("run.ray.resources.reward.memory_gb=10"), [NODE]) == (
        "stage 'reward' asks for 10 GiB of memory; the largest node has 8 GiB of memory "
        "(run.ray.resources.reward.memory_gb)")
    # each fits alone, not all together: memory runs out on the second reward member
    assert check_placement(*asks_for("run.ray.resources.reward.memory_gb=5"), [{**NODE, "CPU": 8.0}]).startswith(
        "stage 'reward-1' cannot be placed: the stages before it (learner, reward-0) take 5 GiB of memory of the "
        "cluster's 8 GiB of memory, and it asks for 5 GiB of memory (run.ray.resources.reward.memory_gb")
    # a custom resource pins a stage to the nodes that have it
    assert check_placement(*asks_for("run.ray.resources.rollout.gen=1"), [NODE, NODE]) == (
        "stage 'rollout' asks for 1 of the resource 'gen'; the cluster has none (run.ray.resources.rollout.gen)")
    assert check_placement(*asks_for("run.ray.resources.rollout.gen=1"), [NODE, {**NODE, "gen": 1.0}]) is None
    # the autoscaled group's last members are named as such
    asks, counts = asks_for("run.autoscale.max_members=8", "run.ray.resources.reward.num_cpus=0.5")
    assert check_placement(asks, counts, [NODE, NODE], scaled_from=2) == (
        "stage 'reward-6' cannot be placed: the stages before it (learner, reward-0..5) take 4 CPUs of the "
        "cluster's 4 CPUs, and it asks for 0.5 CPU (run.ray.resources.reward.num_cpus, or a bigger cluster; "
        "the reward group may grow to run.autoscale.max_members=8)")


def test_env_vars_are_passed_by_name_and_never_echoed(monkeypatch):
    monkeypatch.setenv("STREAMRL_TEST_KEY", "value-1")
    cfg = load_config("local.yaml", ["run.ray.env_vars=[STREAMRL_TEST_KEY]"])
    assert stage_env(cfg) == {"STREAMRL_TEST_KEY": "value-1"}
    monkeypatch.setenv("STREAMRL_SASL_PASSWORD", "pw")  # SASL on: its password goes along unasked
    cfg = load_config("local.yaml", ["bus.sasl_mechanism=PLAIN"])
    assert stage_env(cfg) == {"STREAMRL_SASL_PASSWORD": "pw"}
    monkeypatch.delenv("STREAMRL_SASL_PASSWORD")
    with pytest.raises(ConfigError, match=r"^config field 'bus.sasl_password_env': STREAMRL_SASL_PASSWORD is not set"):
        stage_env(cfg)
    monkeypatch.delenv("STREAMRL_TEST_KEY")
    with pytest.raises(ConfigError, match=r"^config field 'run.ray.env_vars': STREAMRL_TEST_KEY is not set"):
        stage_env(load_config("local.yaml", ["run.ray.env_vars=[STREAMRL_TEST_KEY]"]))
    with pytest.raises(ConfigError) as err:  # a value pasted where a name goes is not repeated
        stage_env(load_config("local.yaml", ["run.ray.env_vars=[sk-live-0123456789]"]))
    assert "sk-live" not in str(err.value) and "entry 0 is not a variable name" in str(err.value)


def test_a_config_file_missing_on_a_node_is_written_there(tmp_path):
    gone = str(tmp_path / "on-the-driver-only.yaml")
    argv = _localise(["reward", "--config", gone, "a.b=1"], {gone: "reward: {max_in_flight: 7}\n"}, tmp_path / "logs")
    assert argv[0] == "reward" and argv[2] != gone and argv[3] == "a.b=1"
    assert Path(argv[2]).read_text() == "reward: {max_in_flight: 7}\n"
    assert Path(argv[2]).parent == tmp_path / "logs"  # the run's own directory, not the temp directory
    here = tmp_path / "here.yaml"
    here.write_text("x")
    assert _localise(["feed", "--config", str(here)], {str(here): "y"}, tmp_path) == ["feed", "--config", str(here)]
