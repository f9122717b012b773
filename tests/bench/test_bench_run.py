"""``streamrl bench run`` (issue 52): the other tree is the named revision exported whole, and the
figures are read from the observation a real run keeps, as ``streamrl run`` writes it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from streamrl.bench.run import export_tree, figures
from streamrl.supervisor.observer import Observation, VersionStats


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_export_tree_is_the_named_revision(tmp_path):
    repo = tmp_path / "repo"
    (repo / "streamrl").mkdir(parents=True)
    _git(repo.parent, "init", "-q", str(repo))
    (repo / "streamrl" / "__init__.py").write_text("VERSION = 'old'\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "old")
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "streamrl" / "__init__.py").write_text("VERSION = 'new'\n")
    (repo / "configs").mkdir()
    (repo / "configs" / "local.yaml").write_text("{}\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "new")
    (tmp_path / "a").mkdir()
    tree = export_tree(old, repo, tmp_path / "a")
    assert (tree / "streamrl" / "__init__.py").read_text() == "VERSION = 'old'\n"
    assert not (tree / "configs").exists()
    (tmp_path / "b").mkdir()
    assert (export_tree("HEAD", repo, tmp_path / "b") / "configs" / "local.yaml").exists()
    with pytest.raises(SystemExit, match="not a revision"):
        export_tree("no-such-ref", repo, tmp_path)


def test_figures_time_the_versions_after_the_warm_start(tmp_path):
    """Version 0 (the warm start) is announced at t=100, version 1 at 110 (the stages' start-up
    on top), then one every 2 s: 2 s per version; rollouts of versions 1-3 over the 6 s span."""
    obs = Observation()
    obs.versions.update({0: 100.0, 1: 110.0, 2: 112.0, 3: 114.0, 4: 116.0})
    for v, n in ((0, 256), (1, 256), (2, 250), (3, 256), (4, 128)):
        obs.by_version[v] = VersionStats(records=n, reward_sum=n * v / 10, first_scored=0.0, last_scored=1.0)
    run = tmp_path / "runs" / "20261128-000000"
    run.mkdir(parents=True)
    obs.save(run / "observation.json")
    got = figures(tmp_path)
    assert got["versions"] == 4
    assert got["s_per_version"] == pytest.approx(2.0)
    assert got["rollouts_per_s"] == pytest.approx((256 + 250 + 256) / 6.0)
    assert got["reward_last"] == pytest.approx(0.4)
    with pytest.raises(RuntimeError, match="no runs/"):
        figures(tmp_path / "empty")
