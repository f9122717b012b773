"""A real `streamrl sandbox` process for the module's tests, with a secret in its environment
(code must never see it), tight limits so abuse ends fast, and verl's code scorers loaded from the
installed wheel's files (verl's package __init__ imports Ray and torch; these do not)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from streamrl.net import free_port
from tests.helpers import binary, stop, wait_for_sync

SECRET = "streamrl-test-secret-6f1d2c"
#: the service's flags: an abuse program ends within seconds
#: the service's own uid range (the local executor of the other tests runs at the default 61000)
UID_BASE = 62000
SERVICE_ARGS = ("--uid-base", str(UID_BASE), "--slots", "4", "--max-run-timeout", "5", "--max-memory-mb", "512",
                "--processes", "32", "--scratch-mb", "16", "--max-output-bytes", str(1 << 20))


def verl_package(name: str) -> ModuleType:
    """verl's ``reward_score/<name>`` package, from the installed wheel's files."""
    found = importlib.util.find_spec("verl")  # the package's place, without running its __init__
    assert found is not None and found.submodule_search_locations, "verl is not installed (pip install --no-deps verl)"
    where = Path(list(found.submodule_search_locations)[0]) / "utils" / "reward_score" / name
    key = f"verl_reward_score_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, where / "__init__.py", submodule_search_locations=[str(where)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def start_service(*extra: str, port: int = 0, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    binary("bwrap")
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "sandbox", "--port", str(port), *SERVICE_ARGS, *extra],
                            env={**os.environ, "STREAMRL_TEST_SECRET": SECRET, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait_for_sync(healthy, 60, "the sandbox service to answer /health")
    return proc, url


@pytest.fixture(scope="module")
def sandbox_service():
    """``(process, base url)`` of a running ``streamrl sandbox``."""
    proc, url = start_service()
    yield proc, url
    stop(proc)
