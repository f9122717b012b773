"""The suite's ``xdist_group`` marks hold under ``make test`` (``-n 4 --dist loadgroup``): a
group's tests run on one worker, so a module's expensive run is set up once. pytest 9.2 with
pytest-xdist 3.8 dropped the groups without a word (every tracked run set up three times); this
notices such a change. And ``make test``'s first pass, the Ray tests alone, selects them all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GROUPED = pytest.mark.xdist_group("groups-self-check")


def under_loadgroup(config: pytest.Config) -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and bool(config.getvalue("loadgroup"))


@GROUPED
def test_a_grouped_test_carries_its_group_to_the_scheduler(request):
    if not under_loadgroup(request.config):
        pytest.skip("runs under `make test` (pytest-xdist --dist loadgroup)")
    assert request.node.nodeid.endswith("@groups-self-check"), request.node.nodeid


def test_make_tests_ray_pass_selects_exactly_the_ray_tests():
    """``make test`` runs ``-m ray`` alone, then ``-m "not ray"``: conftest.py's ``ray`` mark
    must reach pytest's own selection (its hook runs first), or a pass would run no Ray test
    (pytest's exit 5) or run them beside the end-to-end runs again."""
    root = Path(__file__).resolve().parents[2]
    files = {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_ray_*.py")}
    assert files and all(f.startswith("tests/supervisor/") for f in files), files  # one folder to collect
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "ray", "tests/supervisor"], cwd=root, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    selected = [line for line in out.stdout.splitlines() if "::" in line]
    assert len(selected) >= 10 and {test.split("::")[0] for test in selected} == files, selected
