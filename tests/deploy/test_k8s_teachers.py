"""The Kubernetes teachers overlay (docker/k8s/overlays/teachers: the KEDA overlay with on-policy
distillation, one teacher per data source), checked without a cluster like the other variants
(tests/deploy/test_k8s.py): every object validates strictly, every container's command loads
its config, and each teacher of the pipeline config (verl's ``distillation.teacher_models``) has
its own Deployment running ``streamrl teacher --teacher NAME`` and its own ScaledObject on that
teacher's consumer group and input topic, bounded by the topic's partitions; the PodMonitor
scrapes the teachers."""

from __future__ import annotations

from tests.deploy.deploy import check_streamrl_command
from tests.deploy.test_k8s import _partitions, _pipeline_config, _target_env, by_kind, configmap, one, pod_specs, \
    render, validation_errors

VARIANT = "overlays/teachers"


def test_every_object_validates_strictly():
    docs = render(VARIANT)
    problems = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {e}" for d in docs for e in validation_errors(d)]
    assert not problems, "\n".join(problems)


def test_each_teacher_is_its_own_group_scaled_by_keda_on_its_own_lag(tmp_path):
    docs = render(VARIANT)
    cfg = _pipeline_config(docs, tmp_path)
    assert cfg.distillation.enabled and cfg.distillation.routed
    teachers = cfg.distillation.teachers(cfg.teacher)
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind(docs, "ScaledObject")}
    assert set(scaled) == {"streamrl-reward", *(f"streamrl-teacher-{n}" for n in teachers)}
    topic = cfg.bus.topic("rewarded" if cfg.distillation.distillation_loss.use_task_rewards else "rollouts")
    groups = set()
    for name, teacher in teachers.items():
        deploy = one(docs, "Deployment", f"streamrl-teacher-{name}")
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:3] == ["teacher", "--teacher", name]
        assert "replicas" not in deploy["spec"], "KEDA owns the replicas"
        (trigger,) = scaled[f"streamrl-teacher-{name}"]["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka" and meta["topic"] == topic
        assert meta["consumerGroup"] == teacher.group(cfg.bus.group("teacher", "")) == f"streamrl-teacher-{name}"
        groups.add(meta["consumerGroup"])
        spec = scaled[f"streamrl-teacher-{name}"]["spec"]
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] == _partitions(cfg, "rewarded")
        assert _target_env(docs, f"streamrl-teacher-{name}")[meta["bootstrapServersFromEnv"]] \
            == configmap(docs, "streamrl-env")["data"]["STREAMRL_BOOTSTRAP_SERVERS"]
        # each Deployment's pods are its own (a selector shared by two would mix their counts)
        selector = deploy["spec"]["selector"]["matchLabels"]
        assert selector["streamrl.dev/teacher"] == name
    assert len(groups) == len(teachers), "one consumer group per teacher"
    monitor = one(docs, "PodMonitor", "streamrl")
    assert "teacher" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]


def test_every_stage_reads_the_teachers_config_and_each_teacher_container_loads_it(monkeypatch, tmp_path):
    docs = render(VARIANT)
    seen = []
    for where, _, spec in pod_specs(docs):
        container = spec["containers"][0]
        volume = next(v for v in spec["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == configmap(docs, "streamrl-config")["metadata"]["name"], where
        if container["args"][0] != "teacher":
            continue
        args = list(container["args"])
        local = tmp_path / where.replace("/", "_") / "pipeline.yaml"
        local.parent.mkdir(parents=True)
        local.write_text(configmap(docs, "streamrl-config")["data"]["pipeline.yaml"])
        args[args.index("--config") + 1] = str(local)
        env = dict(one(docs, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"])
        cfg = check_streamrl_command(args, env, tmp_path, monkeypatch, where)
        name = args[args.index("--teacher") + 1]
        assert name in cfg.distillation.teachers(cfg.teacher), f"{where}: no teacher {name!r} in the config"
        seen.append(name)
    assert sorted(seen) == sorted(_pipeline_config(docs, tmp_path).distillation.teachers(
        _pipeline_config(docs, tmp_path).teacher))
