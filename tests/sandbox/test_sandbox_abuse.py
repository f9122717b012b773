"""Code a policy might write, on the real `streamrl sandbox` service, through the code scorer: a
fork bomb, an infinite loop, a memory hog, a disk filler (one file, many files, and past the
scratch: `/`, `/dev`, `/dev/shm`), writes and reads outside the scratch dir, reading the service's
environment (a secret is in it), opening sockets, killing the parent (and every process it may
signal), a 100 MB print. Each is contained and scored as a failure with its reason; afterwards the
service is alive, has no process of the code left, and serves correct code again. The cases run at
once (the service's four slots), with tight limits."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import urllib.request
from pathlib import Path

import aiohttp

from streamrl.scorers.code import compute_score
from tests.helpers import ROOT, wait_for_sync
from tests.sandbox.code_cases import fenced
from tests.sandbox.conftest import SECRET, UID_BASE

NONCE = secrets.token_hex(6)
HOST_FILES = [Path("/tmp") / f"streamrl-abuse-{NONCE}", Path(__file__).parent / f"abuse-{NONCE}"]
#: the line an attack prints only when it got through: a contained attack cannot pass the case
ESCAPED = "ESCAPED"


def abuse_programs(service_port: int, service_pid: int) -> dict[str, tuple[str, set[str]]]:
    """name -> (code, the case results that count as contained)."""
    attempt = ("def attempt(what, fn):\n    try:\n        fn()\n        print('ESCAPED', what)\n"
               "    except Exception:\n        pass\n")
    return {
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                      {"timeout"}),
        "infinite_loop": ("while True:\n    pass", {"timeout"}),
        # on a loaded machine a limit may be reached only after the wall time: contained either way
        "memory_hog": ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", {"runtime_error", "timeout"}),
        "disk_filler": ("f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'0' * (1 << 20))\n    f.flush()",
                        {"runtime_error", "timeout"}),
        "disk_filler_files": ("i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'0' * (4 << 20))\n    i += 1",
                              {"runtime_error", "timeout"}),
        # /tmp is the code's own scratch (a tmpfs): writing there works, and the host's /tmp never sees it
        "write_outside": (attempt + f"open({str(HOST_FILES[0])!r}, 'w').write('x')\n"
                          + "".join(f"attempt('write {p}', lambda: open({str(p)!r}, 'w').write('x'))\n"
                                    for p in [*HOST_FILES[1:], Path('/usr/lib/abuse'), Path('/etc/abuse')])
                          + f"import os\nattempt('cwd', lambda: os.chdir({str(ROOT)!r}))\nprint('done')",
                          {"wrong_answer"}),
        # past the scratch: bubblewrap's own root and /dev are tmpfs without a size (host memory)
        "fill_outside_scratch": ("import os\nfor d in ('/', '/dev', '/dev/shm', '/sandbox', '/proc'):\n"
                                 "    written = 0\n    try:\n        for i in range(8):\n"
                                 "            with open(os.path.join(d, f'fill{i}'), 'wb') as f:\n"
                                 "                f.write(b'0' * (4 << 20))\n            written += 4 << 20\n"
                                 "    except OSError:\n        pass\n"
                                 "    if written > 16 << 20:\n        print('ESCAPED', d, written)\n"
                                 "print('done')", {"wrong_answer"}),
        "read_outside": (attempt + "".join(f"attempt('read {p}', lambda: print(open({str(p)!r}).read()[:50]))\n"
                                           for p in [Path(__file__), Path('/etc/hostname'), Path('/etc/passwd'),
                                                     Path.home() / '.bashrc']) + "print('done')",
                         {"wrong_answer"}),
        "read_secret": ("import os, glob\nprint(dict(os.environ))\nfor p in glob.glob('/proc/*/environ'):\n"
                        "    try:\n        print(open(p, 'rb').read())\n    except OSError:\n        pass\n"
                        "print(open('/proc/1/cmdline', 'rb').read())\n"
                        f"print({ESCAPED!r} if {SECRET!r} in str(os.environ) else 'no')",
                        {"wrong_answer"}),
        "sockets": (attempt + "import socket\n"
                    f"attempt('service', lambda: socket.create_connection(('127.0.0.1', {service_port}), timeout=1))\n"
                    "attempt('internet', lambda: socket.create_connection(('1.1.1.1', 53), timeout=1))\n"
                    "attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\nprint('done')",
                    {"wrong_answer"}),
        "kill_parent": ("import os, signal\n"
                        f"for pid in (os.getppid(), {service_pid}, 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                        "    except OSError:\n        pass\n"
                        "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\nprint('done')",
                        {"wrong_answer", "runtime_error"}),
        "print_100mb": ("import sys\nsys.stdout.write('x' * (100 << 20))", {"runtime_error", "timeout"}),
    }


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


def slot_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if UID_BASE <= int(line.split()[0]) < UID_BASE + 64]


def test_abuse_is_contained_scored_as_failure_and_the_service_serves_on(sandbox_service):
    proc, url = sandbox_service
    port = int(url.rsplit(":", 1)[1])
    programs = abuse_programs(port, proc.pid)
    truth = json.dumps({"inputs": [""], "outputs": [ESCAPED]})

    async def attack(name: str, code: str) -> tuple[dict, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/run_code", json={"code": code, "language": "python", "stdin": "",
                                                             "run_timeout": 2, "memory_limit_MB": 256}) as resp:
                assert resp.status == 200, name
                raw = await resp.json()
        scored = await compute_score("apps", fenced(code), truth, sandbox_fusion_url=f"{url}/run_code",
                                     timeout_s=2, memory_limit_mb=256)
        return raw, scored

    async def suite():
        return await asyncio.gather(*(attack(name, code) for name, (code, _) in programs.items()))

    outcomes = dict(zip(programs, asyncio.run(suite())))
    for name, (raw, scored) in outcomes.items():
        allowed = programs[name][1]
        stdout = raw["run_result"]["stdout"] or ""
        assert ESCAPED not in stdout, (name, stdout[:500])
        assert SECRET not in stdout and SECRET not in (raw["run_result"]["stderr"] or ""), name
        assert raw["status"] == "Failed" or name in ("write_outside", "read_outside", "read_secret", "sockets",
                                                     "kill_parent", "fill_outside_scratch"), (name, raw["status"])
        assert scored["score"] == 0.0 and scored["reason"] in allowed, (name, scored)
    assert outcomes["print_100mb"][0]["run_result"]["return_code"] != 0
    assert len(outcomes["print_100mb"][0]["run_result"]["stdout"]) <= 1 << 20
    assert "limit" in outcomes["print_100mb"][0]["run_result"]["stderr"]
    assert outcomes["fork_bomb"][0]["run_result"]["status"] == "TimeLimitExceeded"
    hog = outcomes["memory_hog"][0]["run_result"]
    assert "MemoryError" in hog["stderr"] or hog["status"] == "TimeLimitExceeded"
    assert not [p for p in HOST_FILES if p.exists()]
    # the service lives, nothing of the code is left running, and correct code passes again
    assert proc.poll() is None and get(f"{url}/health")[0] == 200
    wait_for_sync(lambda: not slot_processes(), 30, "the sandboxed processes to be gone")
    ok = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs))"
    table = json.dumps({"inputs": ["2\n1 2\n", "3\n1 1 1\n"], "outputs": ["3\n", "3\n"]})

    async def later():
        return await asyncio.gather(*(compute_score("apps", fenced(ok), table, sandbox_fusion_url=f"{url}/run_code")
                                      for _ in range(8)))

    assert [r["score"] for r in asyncio.run(later())] == [1.0] * 8
    metrics = get(f"{url}/metrics")[1].decode()
    assert 'streamrl_sandbox_executions_total{language="python",outcome="output_limit"}' in metrics
    assert 'streamrl_sandbox_executions_total{language="python",outcome="wall_limit"}' in metrics
