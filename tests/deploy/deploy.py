"""What the deployment tests (``test_compose`` for docker/, ``test_k8s`` for docker/k8s/) check
a command, an environment and the image by: the variables streamrl reads, a ``streamrl`` command
loaded and checked as the stage would at start, the ports Prometheus scrapes, the image's
working directory."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.cli import OVERRIDE, VERBS, build_parser
from streamrl.commands.common import load
from tests.helpers import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
PROMETHEUS = ROOT / "configs" / "prometheus" / "prometheus.yml"


# -- what streamrl reads from the environment --------------------------------------------------

_ENV_READ = re.compile(r"""os\.(?:environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]|getenv\s*\()\s*["']([A-Za-z_]\w*)["']""")
# config fields that name an environment variable (``sasl_password_env``, ``api_key_env``), with
# the name they default to
_ENV_FIELD = re.compile(r"""^\s*\w+_env\s*:\s*str\s*=\s*["']([A-Za-z_]\w*)["']""", re.M)


def streamrl_env_names() -> set[str]:
    """Every environment variable streamrl's source reads by a literal name, and the default
    names of config fields that name one."""
    names: set[str] = set()
    for path in (ROOT / "streamrl").rglob("*.py"):
        text = path.read_text()
        names.update(_ENV_READ.findall(text))
        names.update(_ENV_FIELD.findall(text))
    return names


def env_names_of_config(cfg: Any) -> set[str]:
    """The variables a loaded config names in its ``*_env`` fields (judge / model keys ...)."""
    from omegaconf import OmegaConf

    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if str(key).endswith("_env") and isinstance(value, str) and value:
                    found.add(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return found


# -- a streamrl command, checked as the stage would check it at start --------------------------

def check_streamrl_command(argv: list[str], env: dict[str, str], cwd: Path,
                           monkeypatch: pytest.MonkeyPatch, where: str) -> Any:
    """Parse ``streamrl ARGV`` with ``env`` as the process environment and ``cwd`` as its working
    directory, load its config (packaged name or file, plus overrides) and run the checks the
    verb makes before it starts; return the config."""
    verb = argv[0]
    assert verb in VERBS, f"{where}: {verb!r} is not a streamrl verb ({', '.join(VERBS)})"
    with pytest.raises(SystemExit) as help_exit:
        build_parser().parse_args([verb, "--help"])
    assert help_exit.value.code == 0, f"{where}: streamrl {verb} --help failed"

    for name in [n for n in os.environ if n.startswith(("STREAMRL_", "HF_", "OPENAI_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.chdir(cwd)
    args, extra = build_parser().parse_known_args(argv)  # defaults read the environment
    if verb in SERVICE_VERBS:
        return check_service_command(args, extra, where)
    assert all(OVERRIDE.match(a) for a in extra), f"{where}: unknown arguments {extra}"
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        cfg = load(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: the config does not load from {cwd}: {exc}")

    def validate(section: Any) -> None:  # the section's own start-up check
        check = getattr(section, "validate", None) or getattr(section, "check", None)
        assert check is not None, f"{type(section).__name__} has no validate()"
        check()

    if verb in ("rollout", "learner", "reward", "feed"):
        validate(getattr(cfg, verb))
    if verb == "reward":
        from streamrl.reward.stage import RewardStage

        RewardStage(cfg)  # builds and checks the scorer table; connects nothing
    elif verb == "feed":
        from streamrl.datasets import read_rows

        assert read_rows(cfg.feed.dataset, limit=1), f"{where}: feed.dataset {cfg.feed.dataset!r} is empty"
    elif verb == "topics":
        from streamrl.topics import load_specs

        assert load_specs()
    return cfg


#: verbs that serve HTTP from flags alone, no pipeline config: ``/metrics`` is on their ``--port``
SERVICE_VERBS = ("sandbox",)


def check_service_command(args: Any, extra: list[str], where: str) -> Any:
    """A config-less service's flags, as it checks them at start: no stray arguments, an address
    other containers reach, a fixed port, a language runtime where its sandbox can see it.
    Returns the parsed flags."""
    assert not extra, f"{where}: streamrl {args.verb} takes no {extra}"
    assert args.host == "0.0.0.0", f"{where}: --host {args.host} is not reachable from other containers"
    assert 0 < args.port < 65536, f"{where}: --port {args.port}: a fixed port, scraped and called"
    assert args.slots >= 0 and args.max_run_timeout > 0 and args.max_memory_mb >= args.default_memory_mb > 0, where
    assert not args.allow_unisolated, f"{where}: a deployed sandbox runs policy code: never --allow-unisolated"
    if args.python:  # the sandbox binds /usr read-only and nothing else of the host's tree
        assert args.python.startswith("/usr/"), f"{where}: --python {args.python} is outside /usr"
    return args


def metrics_port(argv: list[str]) -> int | None:
    if argv and argv[0] in SERVICE_VERBS:
        return build_parser().parse_known_args(argv)[0].port
    ports = [int(a.split("=", 1)[1]) for a in argv if a.startswith("metrics.port=")]
    return ports[-1] if ports else None


def prometheus_targets() -> dict[str, dict[str, int]]:
    """job -> {host name: port} of configs/prometheus/prometheus.yml."""
    prom = yaml.safe_load(PROMETHEUS.read_text())
    jobs: dict[str, dict[str, int]] = {}
    for job in prom["scrape_configs"]:
        targets = jobs.setdefault(job["job_name"], {})
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                targets[host] = int(sd["port"])
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                targets[host] = int(port)
    return jobs


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instr.upper(), rest.strip()))
    return stages


def workdir() -> str:
    return [a for i, a in dockerfile_stages()[-1] if i == "WORKDIR"][-1]
