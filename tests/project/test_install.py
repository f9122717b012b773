"""streamrl runs wherever it is installed: the built wheel from an empty directory, a clone of the
repository with nothing beside it; nothing in the repository names a path outside it; first-run
errors are one line that says what to do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: small overrides: the embedded default, two versions, a smaller feed
SMALL_RUN = ["learner.versions=2", "feed.limit=64", "run.reward_members=1", "run.timeout_s=240"]


def _summary(stdout: str) -> dict:
    """The run's last stdout line: its JSON summary."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON summary in stdout:\n{stdout[-2000:]}"
    return json.loads(lines[-1])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "PYTHONPATH"))}
    env.update(extra)
    return env


def _repo_files() -> list[Path]:
    """Every file of the repository git knows of (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, check=True, capture_output=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


#: a path that leaves the repository: the reference desk beside it, or an absolute home/build path
OUTSIDE = re.compile("|".join([
    re.escape("..") + r"/" + "shared",
    # the build machines' roots; paths inside an image (/home/streamrl) are the image's own
    r"(?<![\w.])/" + r"(?:work|root|Users|opt/wheels)\b",
    r"[A-Z]:\\\\(?:Users|work)",
]))


def test_no_path_outside_the_repository():
    """Code, configs, docker files, benches, tests and docs name no path outside the repository:
    not the reference folder beside the checkout, no absolute home or build-machine path. (The
    tests' one way to what other projects publish is ``tests.helpers.SHARED``, found from the
    test file's own place, never a path written out.)"""
    hits = []
    for path in _repo_files():
        if path.suffix in (".png", ".gz", ".whl"):
            continue
        text = path.read_text(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)
    assert OUTSIDE.search("dataset: " + ".." + "/shared/data/gsm8k/train.jsonl")  # the check can fail
    assert OUTSIDE.search("GSM8K = \"/" + "work/shared/data\"")


@pytest.mark.e2e
def test_wheel_runs_the_main_job_from_an_empty_directory(tmp_path: Path, bootstrap: str):
    """Build the wheel, install it into a fresh virtualenv (dependencies from this environment),
    and from an empty directory: ``streamrl topics describe`` and ``streamrl run``."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("streamrl-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # the environment without PYTHONPATH: a checkout on it makes pip skip the install as "satisfied"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300, env=_clean_env())
    # the dependencies come from this environment (not its editable streamrl: a plain path entry
    # does not run that environment's .pth files)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps-from-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _clean_env()
    streamrl = str(venv / "bin" / "streamrl")

    found = subprocess.run([str(py), "-c", "import streamrl; print(streamrl.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.startswith(str(venv)), found.stdout  # the installed wheel, not the checkout

    created = subprocess.run([streamrl, "topics", "create", "--bootstrap-servers", bootstrap, "bus.topic_prefix=wheel"],
                             cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    described = subprocess.run([streamrl, "topics", "describe", "--bootstrap-servers", bootstrap,
                                "bus.topic_prefix=wheel"], cwd=empty, env=env, capture_output=True, text=True,
                               timeout=120)
    assert described.returncode == 0, described.stderr
    assert "wheel.rollouts" in described.stdout and "DRIFT" not in described.stdout

    run = subprocess.run([streamrl, "run", *SMALL_RUN], cwd=empty, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = _summary(run.stdout)
    assert summary["ended"] == "done" and summary["versions"] == 2
    assert summary["records"]["rewarded"] >= 64
    assert Path(summary["out"]).parent == empty / "runs"  # ./runs of where it ran
    assert Path(summary["plot"]).is_file()


@pytest.mark.e2e
def test_a_clone_alone_runs_the_main_job(tmp_path: Path):
    """A clone of the repository with nothing beside it runs the main job (its own code, its own
    packaged data, topics and config)."""
    clone = tmp_path / "alone" / "streamrl"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    assert not (clone.parent.parent / "shared").exists()
    env = _clean_env(PYTHONPATH=str(clone))
    where = subprocess.run([sys.executable, "-c", "import streamrl; print(streamrl.__file__)"], cwd=clone,
                           env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(clone)), where
    run = subprocess.run([sys.executable, "-m", "streamrl", "run", *SMALL_RUN], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = _summary(run.stdout)
    assert summary["ended"] == "done" and summary["versions"] == 2
    assert Path(summary["out"]).is_relative_to(clone / "runs")


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamrl", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_clean_env(), cwd=ROOT)


def test_unreachable_bootstrap_is_one_line_naming_the_address():
    import socket

    # a port held, bound but never listening, for the whole test: connections to it are refused,
    # and no other test's broker can take it (a free port that was only free when picked once
    # answered the run's probe, then went away: the run got as far as its warm start)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        for argv in (["topics", "describe"], ["reward", "--config", "local.yaml"], ["run", "learner.versions=1"]):
            out = _cli(*argv, "--bootstrap-servers", address, timeout=40)
            assert out.returncode == 2, (argv, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
            assert address in lines[0] and "check the address" in lines[0]


def test_bad_override_names_the_command_line_and_bad_file_value_names_the_file(tmp_path: Path):
    out = _cli("topics", "describe", "learner.versions=many")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'learner.versions'" in out.stderr and "command line (learner.versions=many)" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  versions: many\n")
    out = _cli("topics", "describe", "--config", str(bad))
    assert out.returncode == 2 and f"in {bad}" in out.stderr and "'learner.versions'" in out.stderr
    out = _cli("topics", "describe", "--config", "nope.yaml")
    assert out.returncode == 2 and "packaged configs: " in out.stderr and "local.yaml" in out.stderr


def test_version_and_help_list_every_verb():
    from streamrl import __version__
    from streamrl.cli import VERBS

    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"streamrl {__version__}"
    helped = _cli("--help")
    assert helped.returncode == 0
    for verb in VERBS:
        assert re.search(rf"^\s+{verb}\s+\S", helped.stdout, re.M), f"{verb} has no one-line description"


def test_missing_extra_is_one_line_naming_it():
    from streamrl.errors import MissingExtra, need

    with pytest.raises(MissingExtra, match=r"^streamrl run needs no_such_pkg: pip install 'streamrl\[cpu\]'$"):
        need("no_such_pkg.sub", "cpu", "streamrl run")
    assert need("json", "cpu", "x").dumps([1]) == "[1]"


def test_packaged_config_names_and_dataset_names():
    """Configs by packaged name; datasets by hub name or file (the package carries no data set)."""
    from streamrl.datasets import describe, read_rows
    from streamrl.errors import ConfigError
    from streamrl.packaged import resolve_config

    assert resolve_config("local.yaml").resolve() == resolve_config("local").resolve() \
        == resolve_config("configs/local.yaml").resolve()
    assert describe("gsm8k") == "gsm8k (Hugging Face openai/gsm8k:main@train)"
    assert describe("gsm8k:test") == "gsm8k:test (Hugging Face openai/gsm8k:main@test)"
    assert describe("hf:org/set@validation") == "hf:org/set@validation (Hugging Face org/set@validation)"
    assert describe("data/x.jsonl") == "data/x.jsonl"
    with pytest.raises(ConfigError, match=r"^config field 'feed.dataset': no file 'gsm8k.jsonl' \(or a hub name"):
        read_rows("gsm8k.jsonl")
    with pytest.raises(ConfigError, match="'--dataset': required"):
        read_rows("", field="--dataset")


#: the data files the wheel may hold: the project's own topic specs and configs, copied in by
#: setup.py; anything else (a data set, a schema or licence of another project) must not return
OWN_DATA = re.compile(r"^streamrl/_packaged/(topics/[\w-]+\.json|configs/[\w./-]+\.(ya?ml|json))$")


def wheel_files(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def foreign_data(names: list[str]) -> list[str]:
    """What a wheel holds besides Python modules, its metadata and the project's own data."""
    return [n for n in names if not n.endswith(".py") and ".dist-info/" not in n and not OWN_DATA.match(n)]


@pytest.mark.slow
def test_the_wheel_holds_no_data_but_the_projects_own(tmp_path: Path):
    """The wheel, built from the repository's files as a fresh clone has them (no stale build/
    of a checkout), holds code, metadata, topics/ and configs/ and nothing else: no data set,
    schema or licence copied from another project."""
    import shutil

    src = tmp_path / "src"
    for path in _repo_files():
        (src / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, src / path.relative_to(ROOT))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("streamrl-*.whl")
    names = wheel_files(wheel)
    assert not foreign_data(names), f"data in the wheel that is not the project's own: {foreign_data(names)}"
    own = [n for n in names if OWN_DATA.match(n)]
    assert {Path(n).name for n in own} >= {"rollouts.json", "local.yaml"}, own
    assert len(own) == len(list((ROOT / "topics").glob("*.json"))) + \
        len([p for p in (ROOT / "configs").rglob("*") if p.is_file()])
    # the check can fail: what the wheel held before GSM8K and its licence left
    assert foreign_data(["streamrl/data/gsm8k/train.jsonl.gz", "streamrl/data/gsm8k/LICENSE",
                         "streamrl/_packaged/topics/README.md", "streamrl/schemas/compose-spec.json"]) == \
        ["streamrl/data/gsm8k/train.jsonl.gz", "streamrl/data/gsm8k/LICENSE",
         "streamrl/_packaged/topics/README.md", "streamrl/schemas/compose-spec.json"]


#: what a copied data set, schema bundle or licence looks like in a tree
FOREIGN = re.compile(r"(^|/)(LICEN[CS]E|COPYING|NOTICE)[^/]*$|\.(jsonl|parquet|arrow|csv|tsv|gz|zip|tar|bz2|xz)$",
                     re.I)


def foreign_files(names: list[str]) -> list[str]:
    """Repository files that look copied: a data file, an archive, another project's licence, or
    anything under tests/ that is not a test module (what tests need from elsewhere is in shared/)."""
    return [n for n in names if FOREIGN.search(n) or (n.startswith("tests/") and not n.endswith(".py"))]


def test_the_repository_holds_no_copied_files():
    names = [str(p.relative_to(ROOT)) for p in _repo_files()]
    assert "streamrl/datasets.py" in names and not foreign_files(names), foreign_files(names)
    # the check can fail: the copies it replaced
    copies = ["streamrl/data/gsm8k/train.jsonl.gz", "streamrl/data/gsm8k/LICENSE", "tests/data/compose-spec.json",
              "tests/data/crds/keda.sh_scaledobjects.yaml", "tests/data/README.md"]
    assert foreign_files(copies) == copies


def test_a_missing_shared_file_fails_naming_its_path():
    """What the tests take from other projects sits in shared/ beside the clone; a test that misses
    one fails (never skips) and says where it looked."""
    from tests.helpers import SHARED, gsm8k_path, shared_path

    with pytest.raises(pytest.fail.Exception, match=re.escape(str(SHARED / "data" / "none.jsonl")) + " is missing"):
        shared_path("data/none.jsonl")
    assert gsm8k_path("test") == SHARED / "data" / "gsm8k" / "test.jsonl"
