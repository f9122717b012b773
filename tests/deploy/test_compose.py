"""No Docker engine runs here, so docker/docker-compose.yml and docker/Dockerfile are held to the
code by reading them:

- the file is valid against the Compose Specification's JSON Schema (compose-spec.json of shared/schemas/ beside the clone),
  with its variables interpolated as compose does, in the default and the gpu setting;
- every service that runs streamrl runs a real verb (``--help`` works), its flags and overrides
  parse, its config loads from a directory that is not the repository (as in the image) and
  passes the checks the stage makes at start;
- every metrics port is scraped by configs/prometheus/prometheus.yml, and is the port the
  service's healthcheck asks;
- every environment variable set for a streamrl service is one streamrl reads (the list is
  scanned from streamrl/'s source);
- no path (bind mount, build context, Dockerfile, env file) leaves the repository;
- the image is non-root, takes torch pinned from the PyTorch CPU index, and the wheel it builds
  from the build context (what the Dockerfile copies, less .dockerignore) runs its stages from any
  directory.

tests/deploy/test_k8s.py uses the same command and environment checks (tests/deploy/deploy.py) for the Kubernetes
manifests."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

from tests.deploy.deploy import (DOCKERFILE, PROMETHEUS, SERVICE_VERBS, check_streamrl_command, dockerfile_stages,
                                 metrics_port, prometheus_targets, streamrl_env_names, workdir)
from tests.helpers import shared_path

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yml"
GPU_ENV = DOCKER / "gpu.env"
STAGES = ("rollout", "reward", "learner")  # the long-running verbs, each serving metrics


def test_the_environment_scan_finds_what_streamrl_reads():
    names = streamrl_env_names()
    assert {"STREAMRL_BOOTSTRAP_SERVERS", "STREAMRL_LOG_LEVEL", "STREAMRL_TANSU_BIN",
            "STREAMRL_SASL_PASSWORD", "OPENAI_API_KEY"} <= names, names
    assert "PATH" not in names and "STREAMRL_NOT_A_VARIABLE" not in names


# -- the compose file, as compose reads it --------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}|\$([A-Za-z_]\w*)")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``$VAR``, ``$$`` for a literal ``$``."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":-" and not value or op == "-" and value is None:
            return default
        if op in (":?", "?") and not value:
            raise AssertionError(f"${{{name}}} is required: {default}")
        return value or ""

    return _VAR.sub(sub, node)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


RAW = yaml.safe_load(COMPOSE_FILE.read_text())
SETTINGS = {"default": {}, "gpu": read_env_file(GPU_ENV)}


def compose(setting: str = "default") -> dict:
    return interpolate(copy.deepcopy(RAW), SETTINGS[setting])


def active_services(setting: str) -> dict[str, dict]:
    """The services ``docker compose up`` starts in this setting, with at least one replica."""
    env = SETTINGS[setting]
    profiles = {p for p in env.get("COMPOSE_PROFILES", "").split(",") if p}
    out = {}
    for name, svc in compose(setting)["services"].items():
        if svc.get("profiles") and not profiles & set(svc["profiles"]):
            continue
        if int(svc.get("deploy", {}).get("replicas", 1)) < 1:
            continue
        out[name] = svc
    return out


SERVICES = compose()["services"]
ALL_SETTINGS_SERVICES = {**SERVICES, **compose("gpu")["services"]}


def runs_the_streamrl_image(svc: dict) -> bool:
    return str(svc.get("image", "")).startswith("streamrl:")


def runs_streamrl(svc: dict) -> bool:
    """A service whose command is a streamrl invocation (the image's entrypoint, not replaced)."""
    return runs_the_streamrl_image(svc) and "entrypoint" not in svc


def service_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


STREAMRL_SERVICES = {n: s for n, s in ALL_SETTINGS_SERVICES.items() if runs_streamrl(s)}
# the ones on Kafka, with a pipeline config (not the code sandbox: the reward group calls it)
KAFKA_SERVICES = {n: s for n, s in STREAMRL_SERVICES.items() if s["command"][0] not in SERVICE_VERBS}


# -- the schema --------------------------------------------------------------------------------------

def compose_validator() -> jsonschema.Validator:
    schema = yaml.safe_load(shared_path("schemas/compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_file_is_valid_against_the_compose_specification(setting):
    errors = sorted(compose_validator().iter_errors(compose(setting)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_rejects_what_compose_rejects():
    validator = compose_validator()
    for mutate in (
        lambda d: d["services"]["reward"].update(restrat="always"),         # misspelt key
        lambda d: d["services"]["feed"]["depends_on"]["topics"].update(condition="service_done"),
        lambda d: d["services"]["kafka"].update(ports="9094:9094"),          # not a list
        lambda d: d.update(volumez={}),
    ):
        doc = compose()
        mutate(doc)
        assert list(validator.iter_errors(doc)), "a broken file passed the schema"


# -- the stack ----------------------------------------------------------------------------------------

def test_the_stack_has_every_part():
    assert {"kafka", "topics", "feed", "rollout", "reward", "learner", "prometheus", "alertmanager",
            "grafana"} <= SERVICES.keys()
    # reward scales with --scale reward=N: nothing in it may pin one container
    assert "container_name" not in SERVICES["reward"] and "ports" not in SERVICES["reward"]


def test_kafka_is_kraft_with_an_internal_and_a_host_listener_a_volume_and_no_auto_create():
    kafka = SERVICES["kafka"]
    env = {k: str(v) for k, v in kafka["environment"].items()}
    assert kafka["image"].startswith("apache/kafka:") and not kafka["image"].endswith(":latest")
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    listeners = dict(entry.split("://") for entry in env["KAFKA_LISTENERS"].split(","))
    advertised = dict(entry.split("://") for entry in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) <= set(protocols) and set(advertised) <= set(listeners)
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    # the containers' listener: kafka:9092, what every streamrl service is given
    internal = env["KAFKA_INTER_BROKER_LISTENER_NAME"]
    assert advertised[internal] == "kafka:9092"
    for name, svc in KAFKA_SERVICES.items():
        assert service_env(svc).get("STREAMRL_BOOTSTRAP_SERVERS") == "kafka:9092", name
    # the host's listener: advertised on the loopback and published on the same port
    host = [a for n, a in advertised.items() if n != internal]
    assert len(host) == 1 and host[0].split(":")[0] in ("127.0.0.1", "localhost"), host
    port = host[0].rsplit(":", 1)[1]
    assert any(str(p).endswith(f":{port}:{port}") for p in kafka["ports"]), kafka["ports"]
    # the log dirs on a named volume
    log_dir = env["KAFKA_LOG_DIRS"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in kafka["volumes"]}
    assert mounts.get(log_dir) in RAW["volumes"], (log_dir, mounts)
    assert env.get("CLUSTER_ID"), "a fixed cluster id: the volume's log dirs are formatted with it"


def test_the_topics_job_runs_first_and_stages_restart_and_answer_healthchecks():
    assert SERVICES["topics"]["command"][:2] == ["topics", "create"]
    assert SERVICES["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert SERVICES["topics"]["restart"] == "no"
    assert SERVICES["feed"]["restart"] == "on-failure"  # a job: done once it exits 0
    for name, svc in KAFKA_SERVICES.items():
        if name == "topics":
            continue
        assert svc["depends_on"]["topics"]["condition"] == "service_completed_successfully", name
        port = metrics_port(svc["command"])
        if svc["command"][0] in STAGES:
            assert svc["restart"] == "unless-stopped", name
            assert port is not None, f"{name}: a stage serves metrics on a fixed port"
            check = " ".join(svc["healthcheck"]["test"])
            assert f"127.0.0.1:{port}/metrics" in check, f"{name}: healthcheck asks another port"


@pytest.mark.parametrize("name", sorted(STREAMRL_SERVICES))
def test_each_service_command_is_a_real_verb_whose_config_loads_outside_the_repo(name, monkeypatch, tmp_path):
    svc = STREAMRL_SERVICES[name]
    argv = svc["command"]
    cfg = check_streamrl_command(argv, service_env(svc), tmp_path, monkeypatch, f"compose service {name}")
    if argv[0] in SERVICE_VERBS:  # flags only, checked as the service checks them
        assert cfg.port == metrics_port(argv)
        return
    assert cfg.bus.bootstrap_servers == "kafka:9092"
    if metrics_port(argv) is not None:
        # Prometheus scrapes it from another container: not the loopback default
        assert cfg.metrics.host == "0.0.0.0" and cfg.metrics.port == metrics_port(argv), name
    if argv[0] == "learner":
        assert cfg.learner.versions == 0, f"{name}: a learner that finishes would be restarted"


@pytest.mark.parametrize("name", sorted(n for n, s in ALL_SETTINGS_SERVICES.items() if runs_the_streamrl_image(s)))
def test_every_environment_variable_set_is_one_streamrl_reads(name):
    known = streamrl_env_names()
    env = service_env(ALL_SETTINGS_SERVICES[name])
    unknown = sorted(set(env) - known)
    assert not unknown, f"{name} sets {unknown}, which streamrl never reads"
    for var in env:  # secrets come from the host's environment or a secret store, never this file
        if re.search(r"PASSWORD|API_KEY|TOKEN|SECRET", var):
            assert env[var] in ("", None), f"{name}: {var} has a value in the compose file"


def test_prometheus_scrapes_every_metrics_port_under_the_stages_job_name():
    jobs = prometheus_targets()
    for name, svc in STREAMRL_SERVICES.items():
        port = metrics_port(svc["command"])
        if port is None:
            continue
        verb = svc["command"][0]
        # one job per stage, named as the alerts and the dashboard expect, whichever variant runs
        assert jobs.get(verb, {}).get(name) == port, f"{name}: port {port} is not scraped in job {verb}"
    for job, targets in jobs.items():
        for host in targets:
            assert host == "localhost" or host in ALL_SETTINGS_SERVICES, \
                f"prometheus job {job} scrapes {host}, which is no compose service"
    prom = yaml.safe_load(PROMETHEUS.read_text())
    for rule_file in prom.get("rule_files", []):
        assert (PROMETHEUS.parent / rule_file).exists()
    # a stage that disappears entirely is alerted on by its job name
    alerts = yaml.safe_load((PROMETHEUS.parent / "alerts.yml").read_text())
    exprs = [" ".join(r["expr"].split()) for g in alerts["groups"] for r in g["rules"] if "alert" in r]
    for stage in STAGES:
        assert stage in jobs and any(f'absent(up{{job="{stage}"}}' in e for e in exprs), stage
    am = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0]
    host, port = am.split(":")
    assert host in SERVICES and any(str(p).endswith(f":{port}") for p in SERVICES[host]["ports"])


# -- paths ----------------------------------------------------------------------------------------------

def _inside_repo(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def host_paths(services: dict[str, dict]) -> Iterator[tuple[str, str]]:
    """(service, path) for every host path the services name."""
    for name, svc in services.items():
        build = svc.get("build")
        if isinstance(build, str):
            build = {"context": build}
        if build:
            yield name, build["context"]
            if "dockerfile" in build:
                yield name, str(Path(build["context"]) / build["dockerfile"])
        for volume in svc.get("volumes", []):
            if isinstance(volume, dict):
                if volume.get("type") == "bind":
                    yield name, volume["source"]
                continue
            source = str(volume).split(":")[0]
            if source.startswith((".", "/", "~")):
                yield name, source
            else:
                assert source in RAW["volumes"], f"{name}: volume {source} is not declared"
        env_files = svc.get("env_file", [])
        for item in [env_files] if isinstance(env_files, (str, dict)) else env_files:
            yield name, item["path"] if isinstance(item, dict) else item
        if "extends" in svc and "file" in svc["extends"]:
            yield name, svc["extends"]["file"]


def test_no_path_leaves_the_repository():
    doc = compose()
    for name, path in host_paths(ALL_SETTINGS_SERVICES):
        assert not path.startswith(("/", "~")), f"{name}: absolute host path {path}"
        assert _inside_repo(DOCKER / path), f"{name}: {path} is outside the repository"
        assert (DOCKER / path).exists(), f"{name}: {path} does not exist"
    for section in ("configs", "secrets"):
        for key, item in (doc.get(section) or {}).items():
            if "file" in item:
                assert _inside_repo(DOCKER / item["file"]), f"{section}.{key}"
    for item in doc.get("include", []):
        for p in [item] if isinstance(item, str) else item.get("path", []):
            assert _inside_repo(DOCKER / p), f"include {p}"
    # and nothing of the old layout: data mounted from beside the checkout
    for text in (COMPOSE_FILE.read_text(), DOCKERFILE.read_text(), GPU_ENV.read_text()):
        assert "shared/data" not in text and "../.." not in text


def test_the_path_check_catches_a_path_outside():
    bad = {"x": {"volumes": ["../../" + "shared/data:/data:ro"]}}
    assert not all(_inside_repo(DOCKER / p) for _, p in host_paths(bad))


def test_learner_and_rollout_share_the_weights_at_relative_paths_under_the_workdir(monkeypatch, tmp_path):
    """The learner announces each version's absolute path; the rollout workers read it there."""
    for setting in SETTINGS:
        for name, svc in active_services(setting).items():
            if not runs_streamrl(svc) or svc["command"][0] != "learner":
                continue
            cfg = check_streamrl_command(svc["command"], service_env(svc), tmp_path, monkeypatch, name)
            for rel in (cfg.learner.weights_dir, cfg.learner.checkpoint_dir):
                assert not Path(rel).is_absolute() and ".." not in Path(rel).parts, rel
            mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in svc["volumes"]}
            weights = f"{workdir()}/{cfg.learner.weights_dir}"
            assert mounts.get(f"{workdir()}/{cfg.learner.checkpoint_dir}") in RAW["volumes"], name
            assert mounts.get(weights) in RAW["volumes"], name
            readers = [n for n, s in active_services(setting).items()
                       if runs_streamrl(s) and s["command"][0] == "rollout"]
            assert readers, setting
            for reader in readers:
                theirs = {str(v).split(":")[1]: str(v).split(":") for v in active_services(setting)[reader]["volumes"]}
                assert theirs[weights][0] == mounts[weights] and theirs[weights][-1] == "ro", reader


# -- profiles -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_each_setting_runs_each_stage_once(setting):
    """Two variants of a stage in one consumer group would mix policies or scorers."""
    active = active_services(setting)
    for verb in ("topics", "feed", *STAGES):
        runners = [n for n, s in active.items() if runs_streamrl(s) and s["command"][0] == verb]
        assert len(runners) == 1, f"{setting}: {verb} runs in {runners}"


def test_the_gpu_profile_reserves_gpus_and_points_the_stages_at_its_servers(monkeypatch, tmp_path):
    gpu = compose("gpu")["services"]
    servers = {n: s for n, s in gpu.items() if s.get("profiles") == ["gpu"] and not runs_the_streamrl_image(s)}
    assert {"policy-server", "reward-model-server"} <= servers.keys()
    for name in [*servers, "learner-gpu"]:
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), name
    for name, svc in servers.items():
        assert svc["entrypoint"] == ["vllm", "serve"] and not svc["image"].endswith(":latest"), name

    def served(host: str) -> str:
        cmd = servers[host]["command"]
        assert cmd[cmd.index("--port") + 1] == "8000"
        return cmd[cmd.index("--served-model-name") + 1]

    rollout = check_streamrl_command(gpu["rollout-gpu"]["command"], service_env(gpu["rollout-gpu"]),
                                     tmp_path, monkeypatch, "rollout-gpu")
    assert rollout.rollout.backend == "openai"
    host = re.match(r"http://([\w-]+):8000/v1$", rollout.rollout.openai.base_url).group(1)
    assert rollout.rollout.openai.model == served(host)
    assert "policy-server" in gpu["rollout-gpu"]["depends_on"]

    reward = check_streamrl_command(gpu["reward-gpu"]["command"], service_env(gpu["reward-gpu"]),
                                    tmp_path, monkeypatch, "reward-gpu")
    models = [s.model for s in reward.reward.scorers.values() if s.type == "model"]
    assert models, "reward-gpu has no model scorer"
    for model in models:
        for url in model["urls"]:
            host = re.match(r"http://([\w-]+):8000$", url).group(1)
            assert model["model"] == served(host)

    learner = check_streamrl_command(gpu["learner-gpu"]["command"], service_env(gpu["learner-gpu"]),
                                     tmp_path, monkeypatch, "learner-gpu")
    assert learner.learner.device.startswith("cuda")
    # the learner trains the weights the policy server serves: one volume, one directory
    policy_dir = servers["policy-server"]["command"][0]
    server_mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in servers["policy-server"]["volumes"]}
    learner_mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in gpu["learner-gpu"]["volumes"]}
    server_volume = server_mounts[str(Path(policy_dir).parent)]
    learner_dir = f"{workdir()}/{learner.learner.policy}"
    assert learner_mounts[str(Path(learner_dir).parent)] == server_volume
    assert Path(policy_dir).name == Path(learner_dir).name
    assert f"models/{Path(policy_dir).name}" in gpu["model-fetch"]["command"][0]


# -- the image ------------------------------------------------------------------------------------------

def dockerignore_excludes(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (a path under the repository root) out of the build
    context: the last matching pattern wins, ``!`` re-includes, a pattern matching a parent
    directory matches what is inside it (Docker's rules)."""
    excluded = False
    parts = Path(rel).parts
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = regex.replace("\0/", "(?:.*/)?").replace("\0", ".*")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_the_dockerignore_matcher_and_the_build_context():
    assert dockerignore_excludes(".venv/bin/python") and dockerignore_excludes(".git/HEAD")
    assert dockerignore_excludes("tests/deploy/test_compose.py") and dockerignore_excludes("runs/x/y")
    assert dockerignore_excludes("streamrl/__pycache__/cli.cpython-311.pyc")
    assert not dockerignore_excludes("streamrl/cli.py") and not dockerignore_excludes("pyproject.toml")


def build_context_files() -> list[str]:
    """The files the Dockerfile copies from the build context, after .dockerignore."""
    files = []
    for stage in dockerfile_stages():
        for instr, args in stage:
            if instr != "COPY" or "--from=" in args:
                continue
            *sources, _ = [a for a in args.split() if not a.startswith("--")]
            for source in sources:
                path = ROOT / source
                assert path.exists(), f"the Dockerfile copies {source}, which does not exist"
                assert not dockerignore_excludes(source), f".dockerignore keeps {source} out"
                for f in ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())):
                    rel = str(f.relative_to(ROOT))
                    if not dockerignore_excludes(rel):
                        files.append(rel)
    return files


def test_the_image_runs_as_an_unprivileged_user_with_pinned_cpu_torch():
    final = dockerfile_stages()[-1]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    runs = " ".join(a for i, a in final if i == "RUN")
    assert re.search(r"useradd .*--uid (\d+) .*streamrl", runs)
    uid = re.search(r"useradd .*--uid (\d+)", runs).group(1)
    assert users[-1].split(":")[0] in (uid, "streamrl")
    args = dict(a.split("=", 1) for i, a in final if i == "ARG" and "=" in a)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    torch_install = [r for r in runs.split("&&") if "pip install" in r and "torch" in r.split()]
    assert torch_install and "--index-url" in torch_install[0] and "-c " in torch_install[0], runs
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    assert pins, "constraints.txt pins no torch version"
    assert [a for i, a in final if i == "ENTRYPOINT"] == ['["streamrl"]']
    assert not [a for i, a in final if i == "ENV" and "STREAMRL_TOPICS_DIR" in a]
    assert workdir().startswith("/") and "mkdir -p runs/learner" in runs


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """The wheel the Dockerfile's build stage makes, from the same files, unpacked as pip
    installs a pure-Python wheel."""
    ctx = tmp_path_factory.mktemp("context")
    for rel in build_context_files():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ctx / rel)
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out), str(ctx)],
                          capture_output=True, text=True, timeout=180, cwd=ctx)
    assert proc.returncode == 0, f"the image's wheel does not build from its context:\n{proc.stderr[-3000:]}"
    (wheel,) = out.glob("streamrl-*.whl")
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    return target


@pytest.mark.slow
def test_the_wheel_the_image_installs_runs_its_stages_from_any_directory(installed_wheel, tmp_path):
    """In the image there is no repository: configs, topics and data come from the package."""
    argvs = [s["command"] for s in KAFKA_SERVICES.values()]
    probe = f"""
import os, sys
import streamrl
assert streamrl.__file__.startswith({str(installed_wheel)!r}), streamrl.__file__
from streamrl.cli import build_parser
from streamrl.commands.common import load
from streamrl.topics import load_specs
from streamrl.datasets import read_rows
assert load_specs()
for argv in {argvs!r}:
    args, extra = build_parser().parse_known_args(argv)
    args.overrides = [*getattr(args, "overrides", []), *extra]
    cfg = load(args)
    if argv[0] == "feed":
        assert read_rows(cfg.feed.dataset, limit=1)
print("ok")
"""
    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{installed_wheel}{os.pathsep}{site}",
           "STREAMRL_BOOTSTRAP_SERVERS": "kafka:9092", "HF_HUB_OFFLINE": "1"}
    # -S: no site hooks, so the checkout's editable install cannot answer for the wheel
    proc = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# -- the code sandbox group (issue 64) ------------------------------------------------------------------

def test_the_sandbox_group_is_its_own_scalable_healthchecked_scraped_service():
    sandboxes = {n: s for n, s in STREAMRL_SERVICES.items() if s["command"][0] == "sandbox"}
    assert list(sandboxes) == ["sandbox"] and "profiles" not in SERVICES["sandbox"]
    svc = SERVICES["sandbox"]
    # --scale sandbox=N: nothing pins one container; the members share the service name
    assert "container_name" not in svc and "ports" not in svc
    assert svc["restart"] == "unless-stopped"
    port = metrics_port(svc["command"])
    check = " ".join(svc["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in check
    assert prometheus_targets()["sandbox"] == {"sandbox": port}
    # what bubblewrap needs to create its namespaces in a container, and no capability
    opts = set(svc["security_opt"])
    assert {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"} <= opts
    assert "no-new-privileges:true" in opts and svc["cap_drop"] == ["ALL"]
    assert not svc.get("privileged") and not svc.get("cap_add") and "user" not in svc
    # the interpreter it runs code with is the image's, where the sandbox sees it (/usr)
    args = svc["command"]
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    assert base.startswith("python:") and args[args.index("--python") + 1] == "/usr/local/bin/python3"


def test_the_image_installs_bubblewrap():
    runs = " ".join(a for i, a in dockerfile_stages()[-1] if i == "RUN")
    assert re.search(r"apt-get install -y (--no-install-recommends )?bubblewrap", runs), runs


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_reward_group_calls_the_sandbox_group(setting, monkeypatch, tmp_path):
    port = metrics_port(SERVICES["sandbox"]["command"])
    rewards = {n: s for n, s in active_services(setting).items() if runs_streamrl(s) and s["command"][0] == "reward"}
    assert rewards and "sandbox" in active_services(setting)
    for name, svc in rewards.items():
        cfg = check_streamrl_command(svc["command"], service_env(svc), tmp_path, monkeypatch, name)
        code = cfg.reward.scorers["code"]
        assert code.type == "rule" and code.rule == "code"
        assert code.kwargs["sandbox_fusion_url"] == f"http://sandbox:{port}/run_code", name
