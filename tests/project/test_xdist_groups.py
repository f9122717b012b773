"""The suite's ``xdist_group`` marks hold under ``make test`` (``-n 4 --dist loadgroup``): a
group's tests run on one worker, so a module's expensive run is set up once and two Ray heads
never share the machine. pytest 9.2 with pytest-xdist 3.8 dropped the groups without a word
(every tracked run set up three times); this notices such a change."""

from __future__ import annotations

import os

import pytest

GROUPED = pytest.mark.xdist_group("groups-self-check")


def under_loadgroup(config: pytest.Config) -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and bool(config.getvalue("loadgroup"))


@GROUPED
def test_a_grouped_test_carries_its_group_to_the_scheduler(request):
    if not under_loadgroup(request.config):
        pytest.skip("runs under `make test` (pytest-xdist --dist loadgroup)")
    assert request.node.nodeid.endswith("@groups-self-check"), request.node.nodeid


def test_the_groups_conftest_adds_reach_the_scheduler(request):
    """conftest.py puts the Ray tests in one group; its hook must run before xdist's."""
    if not under_loadgroup(request.config):
        pytest.skip("runs under `make test` (pytest-xdist --dist loadgroup)")
    ray_tests = [i for i in request.session.items if i.fspath.basename.startswith("test_ray_")]
    if not ray_tests:
        pytest.skip("no Ray test collected in this selection")
    assert all(i.nodeid.endswith("@ray") for i in ray_tests), [i.nodeid for i in ray_tests][:3]
