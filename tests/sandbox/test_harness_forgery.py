"""A function case's result cannot be forged (streamrl/sandbox/harness.py says why and how): the
response's code runs in a child the harness's parent watches, and the only thing it can hand
back is one value for its own case. Each attack below knows the expected output (3 for ``add(1,
2)``) and tries to get a pass without returning it: stealing a marker and printing, writing to
every open descriptor, monkeypatching the encoder, ``json``, ``marshal`` and builtins, exiting
early, killing the parent. Each must fail; an honest solution, next to them, passes. All run
locally in the real isolated executor (bubblewrap), as the reward member runs them."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrl.sandbox import harness
from streamrl.scorers.code import compute_score
from tests.helpers import binary
from tests.sandbox.code_cases import fenced

#: two cases: each attack must fail both (the second case's expected value is 7)
TABLE = json.dumps({"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "7"]})
TIMEOUT_S = 3.0

# every string the code can reach in its process: frames, gc, argv, environment, /proc, its program
_STEAL = r'''
import gc, os, re, sys


def secrets_in_reach():
    found = set()
    f = sys._getframe()
    while f is not None:
        for d in (f.f_globals, f.f_locals):
            for v in list(d.values()):
                if isinstance(v, str) and len(v) < 200:
                    found.add(v)
                elif isinstance(v, tuple):
                    found.update(x for x in v if isinstance(x, str) and len(x) < 200)
        f = f.f_back
    for o in gc.get_objects():
        if isinstance(o, dict):
            found.update(v for v in list(o.values()) if isinstance(v, str) and len(v) < 200)
    found.update(sys.argv)
    found.update(os.environ.values())
    for path in ("/proc/self/cmdline", "/proc/self/environ", "/sandbox/main.py", "/proc/1/cmdline",
                 "/proc/1/environ", "/proc/%d/cmdline" % os.getppid(), "/proc/%d/environ" % os.getppid()):
        try:
            found.update(re.findall(r"[0-9A-Za-z_]{16,64}", open(path, errors="replace").read()))
        except OSError:
            pass
    return found


def forge(value):
    lines = ["", str(value), json.dumps(value)] + [s + json.dumps(value) for s in secrets_in_reach()]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()
    os.write(1, text.encode())
    for target in ("/proc/self/fd/1", "/proc/1/fd/1", "/proc/%d/fd/1" % os.getppid()):
        try:
            with open(target, "w") as out:
                out.write(text)
        except OSError:
            pass
'''

# a frame in the harness's own child-to-parent format, written to every descriptor there is
_EVERY_FD = r'''
import marshal, os


def frame(value):
    data = marshal.dumps(value, 4)
    return len(data).to_bytes(8, "big") + data


def write_everywhere(data):
    fds = set(range(256))
    try:
        fds.update(int(x) for x in os.listdir("/proc/self/fd"))
    except OSError:
        pass
    for fd in sorted(fds):
        try:
            os.fstat(fd)
            os.write(fd, data)
        except OSError:
            pass


def pipes():
    import stat
    return [fd for fd in range(3, 256) if _is_fifo(fd, stat)]


def _is_fifo(fd, stat):
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False
'''

# the encoder, json, marshal, os.write and builtins replaced by ones that say 3, whatever is returned
_PATCH = r'''
import builtins, gc, json, marshal, numbers, os, sys, types

_real_dumps, _real_write = marshal.dumps, os.write


def patch_everything(value):
    framed = lambda *a, **k: _real_dumps(value, 4)
    json.dumps = lambda *a, **k: json.JSONEncoder().encode(value)
    json.JSONEncoder.encode = lambda self, o: "%d" % value
    marshal.dumps = framed
    os.write = lambda fd, data: _real_write(fd, data if fd in (1, 2) else
                                            len(framed()).to_bytes(8, "big") + framed())
    constant = eval("lambda *a, **k: %r" % value)
    for o in gc.get_objects():
        if isinstance(o, types.FunctionType) and o.__code__.co_filename in ("/sandbox/main.py", "<encoder>"):
            try:
                o.__code__ = constant.__code__
            except (ValueError, TypeError):
                pass
    for name in ("int", "float", "repr", "str", "len"):
        setattr(builtins, name, constant)
    numbers.Integral = numbers.Real = object
'''


def _score(code: str) -> dict:
    binary("bwrap")
    return asyncio.run(compute_score("apps", fenced(code), TABLE, timeout_s=TIMEOUT_S))


def _fails(result: dict) -> None:
    assert result["score"] == 0.0 and result["passed"] == 0, result
    assert "pass" not in result["results"], result


ATTACKS = {
    # (a) + (d): a marker read from anywhere, printed with the expected value, then an exit
    "stolen_marker_printed_then_exit": _STEAL + "def add(a, b):\n    forge(a + b)\n    os._exit(0)\n",
    "stolen_marker_printed_then_wrong_return": _STEAL + "def add(a, b):\n    forge(a + b)\n    return a - b\n",
    "expected_printed_then_sys_exit_0": "import sys\ndef add(a, b):\n    print(a + b)\n    sys.exit(0)\n",
    "expected_printed_at_import_then_exit": "import os\nprint(3)\nprint(7)\nos._exit(0)\n",
    # (b): every descriptor (the harness's pipe included) gets text and a well-formed frame
    "every_fd_then_wrong_return": _EVERY_FD + "def add(a, b):\n    write_everywhere(b'\\n3\\n' + frame(a + b))\n"
                                              "    return a - b\n",
    "every_fd_then_exit": _EVERY_FD + "def add(a, b):\n    write_everywhere(frame(a + b) + frame(a + b))\n"
                                      "    os._exit(0)\n",
    "frame_then_crash": _EVERY_FD + "def add(a, b):\n    [os.write(fd, frame(a + b)) for fd in pipes()]\n"
                                    "    raise RuntimeError('after the frame')\n",
    "frame_then_hang": _EVERY_FD + "def add(a, b):\n    [os.write(fd, frame(a + b)) for fd in pipes()]\n"
                                   "    while True:\n        pass\n",
    "truncated_frame_then_exit": _EVERY_FD + "def add(a, b):\n    [os.write(fd, frame(a + b)[:-1]) for fd in pipes()]\n"
                                             "    os._exit(0)\n",
    # a hand-written frame carries a value, never a verdict
    "verdict_frame_then_exit": _EVERY_FD + "def add(a, b):\n"
                                           "    [os.write(fd, frame({'score': 1.0, 'verdict': 'pass'})) for fd in pipes()]\n"
                                           "    os._exit(0)\n",
    # (c): the encoder, json, marshal, os and builtins replaced, then a wrong value returned
    "encoder_patched_then_wrong_return": _PATCH + "def add(a, b):\n    patch_everything(a + b)\n    return a - b\n",
    "encoder_patched_then_liar_returned": _PATCH + "class Liar:\n    def __eq__(self, other):\n        return True\n"
                                                   "def add(a, b):\n    patch_everything(a + b)\n    return Liar()\n",
    # the parent killed, the answer printed where its stdout was
    "parent_killed_then_printed": _STEAL + "import signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
                                           "    forge(a + b)\n    return a + b\n",
    "parent_memory_and_trace": "import os, ctypes\ndef add(a, b):\n"
                               "    assert ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0) != 0  # PTRACE_ATTACH refused\n"
                               "    for p in ('mem', 'fd/1'):\n"
                               "        try:\n"
                               "            open('/proc/%d/%s' % (os.getppid(), p), 'wb')\n"
                               "            raise SystemExit(5)\n"
                               "        except PermissionError:\n"
                               "            pass\n"
                               "    raise SystemExit(0)\n",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_forgery_scores_a_fail(name):
    result = _score(ATTACKS[name])
    _fails(result)
    if name == "frame_then_hang":
        assert result["results"] == ["timeout", "timeout"], result
    if name in ("encoder_patched_then_wrong_return", "encoder_patched_then_liar_returned", "verdict_frame_then_exit"):
        assert result["results"] == ["wrong_answer", "wrong_answer"], result  # a value came back: not the expected


@pytest.mark.parametrize("code", [
    "def add(a, b):\n    return a + b\n",
    "class Solution:\n    def add(self, a, b):\n        print('debug', a, b)\n        return a + b\n",
    # a process left running after a correct return: ended by the harness, not waited for
    "import os, time\ndef add(a, b):\n    if os.fork() == 0:\n        time.sleep(60)\n    return a + b\n",
], ids=["function", "solution_class_printing", "leaves_a_process"])
def test_an_honest_solution_passes(code):
    result = _score(code)
    assert result["score"] == 1.0 and result["results"] == ["pass", "pass"], result


@pytest.mark.parametrize("stdout", [
    "", "3", "3\n3\n", "\n3\n", " 3\n", "3 \n", "[3,4]\n", '{"__tuple__":[3]}\n',
    "[" * 5000 + "]" * 5000 + "\n", '{"__tuple__": 5}\n', '{"__dict__": [[[[1]], 2]]}\n',
    '{"__float__": "x"}\n', "NaN x\n", '"' + "a" * (2 * harness.VALUE_BYTES) + '"\n',
])
def test_what_the_scorer_reads_back_is_one_bounded_json_line(stdout):
    """Whatever reached a run's stdout (a process other than the parent, through some route), the
    scorer reads the parent's canonical line of bounded depth (not a space more) or nothing; it
    never raises."""
    found, _ = harness.returned(stdout)
    assert not found


def test_the_scorer_decodes_tagged_values():
    assert harness.returned('{"__tuple__": [1, {"__dict__": [[2, [3]]]}]}\n') == (True, (1, {2: [3]}))
    assert harness.returned("3\n") == (True, 3)


def test_the_child_cannot_reach_into_its_parent():
    """The parent is non-dumpable: the child (same uid, no capability) cannot ptrace it nor open
    its memory, descriptors or environment; and its own stdout is no longer the run's stdout."""
    from streamrl.sandbox.isolation import Executor, Limits, probe

    binary("bwrap")
    code = ("import ctypes, os, sys\n"
            "def add(a, b):\n"
            "    seen = ['ptrace=%d' % ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0)]\n"
            "    for p in ('mem', 'fd/1', 'environ'):\n"
            "        try:\n"
            "            open('/proc/%d/%s' % (os.getppid(), p), 'rb').close()\n"
            "            seen.append(p + '=open')\n"
            "        except OSError as e:\n"
            "            seen.append(p + '=' + type(e).__name__)\n"
            "    print(' '.join(seen))\n"
            "    return a + b\n")

    async def main():
        executor = Executor(probe(), slots=1)
        return await executor.run("python", harness.program(code, "add", "prime"), "1\n2", Limits(wall_s=TIMEOUT_S))

    result = asyncio.run(main())
    assert result.return_code == 0 and result.stdout == "3\n", result
    assert "ptrace=-1 mem=PermissionError fd/1=PermissionError environ=PermissionError" in result.stderr, result
