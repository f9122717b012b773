"""The program a test case runs in the sandbox: the response's code, wrapped the way verl's two
code scorers run it, and (for a function-call case) its return value handed back as data.

verl scores code two ways, and a case means a slightly different thing in each:

- ``prime`` (verl's ``prime_code``, no sandbox URL): the code is compiled as a module named
  ``tmp_sol`` after a prelude of standard-library imports and a raised recursion limit; a trailing
  ``if __name__ == '__main__':`` block is unwrapped; ``sys.exit`` ends a stdin program normally;
  a function case calls ``fn_name`` on the module (on ``Solution()`` when the code defines
  ``class Solution``) with one JSON value per input line, and passes when the return value equals
  the expected JSON value (compared by the scorer, outside the sandbox: ``returned``).
- ``sandbox_fusion`` (verl's SandboxFusion client): a stdin case runs the code itself; a function
  case runs it as the main module after the same import prelude, calls ``fn_name`` from its globals
  (else ``Solution().fn_name``) and prints the result as verl's wrapper prints it (JSON for
  containers, ``None`` and bools, ``str`` otherwise); stdout is compared with the expected output.
  That is verl's meaning (what the program prints is its answer), so a print is an answer there,
  and the program goes unchanged to any SandboxFusion service.

How a prime function case's return value gets out, and why this way
-------------------------------------------------------------------

The code runs in the same sandbox as whatever reports its result, and anything in the process
the code runs in is the code's: it can read the harness's globals and frames (``sys._getframe``,
``gc.get_objects``), its argv, stdin, environment and ``/proc/self``, scan and write every open
file descriptor, replace any function (``__code__``, module attributes, ``json``), install a trace
function that rewrites a frame's locals, and end the process whenever it likes. A secret marker on
stdout (this module's first design) is therefore no secret: the code printed the marker and any
value it liked, then ``os._exit(0)``. So the result must not be *framed* by that process:

1. The harness starts as a **parent** that never runs a line of the response: it reads the case's
   input, parses the arguments, makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: the child,
   under the same uid without capabilities, cannot ptrace it nor open its ``/proc/<pid>/fd`` or
   ``mem``), opens a pipe and forks the **child**.
2. The child points its stdout at stderr and closes every descriptor but 0, 1, 2 and the pipe's
   write end, *then* loads the code and calls the function. Its prints go to stderr, which no
   verdict reads: printing cannot forge anything. It turns the return value into tagged plain
   data (tuples, dict keys, non-finite floats and other types kept apart) with an encoder
   compiled only after the function returned and from primitives captured before the code loaded,
   and sends it with ``marshal.dumps`` (a builtin, captured likewise, that refuses every
   non-builtin type) as one length-prefixed frame, then exits.
3. The parent takes the child's bytes as **data**: it waits for the child to exit (killing what
   the child left behind), accepts exactly one frame whose length matches to the byte, of plain
   types only, nesting and size bounded, and only if the child exited with status 0. Then it, and
   only it, writes one JSON line on stdout and exits 0. A child that crashes, exits early (also
   ``os._exit(0)`` after printing the expected output), writes no frame, two frames, junk, or a
   truncated frame makes the parent exit non-zero: a fail. A child killed by a signal (the CPU
   limit) kills the parent with the same signal, so the scorer sees the same limit.
4. The scorer (``returned``) accepts a run only when the parent exited 0 and stdout is byte for
   byte the line the parent writes (canonical JSON, one line); anything more is a fail, and the
   line is decoded as data with its depth bounded. There is another route to stdout: when the
   service runs as a user other than root, the run's pipes belong to that user, and the code can
   reopen them through ``/proc/1/fd`` (bubblewrap's pid-1 reaper holds them; measured). What it
   writes there only adds bytes to the parent's line, which is then not accepted.

What the code can still do, and why that is not a forgery: inside its own process it can always
change what the child sends (with ``ctypes`` or a trace function, whatever this harness does), or
write a well-formed frame to the pipe itself and exit. All that reaches the verdict is then *one
value of the code's choosing for this case*, which is exactly what returning that value does: the
pass needs the value to equal the expected output, which never enters the sandbox (the scorer
holds it), so no framing trick passes a case the code could not pass by returning its answer.
What it cannot do: make a printed line count, turn an error, an early exit or a hang into a pass,
deliver two answers, or reach another case's result: each case is its own execution (its own
bubblewrap, pid namespace, scratch, stdout pipe and, as root, uid), started by the scorer, which
reads that execution's stdout for that case only. Monkeypatching the encoder, ``json``,
``marshal`` or ``os`` in the child changes nothing that is sent (the child uses neither module
attributes nor functions that existed while the code ran).
"""

from __future__ import annotations

import json
from typing import Any

#: the standard-library modules both of verl's runners import, ``*`` and by name, before the code
PRELUDE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                   "statistics", "itertools", "functools", "operator", "io", "sys", "json")
RECURSION_LIMIT = 6 * 10**5  # prime_code's
#: the most bytes a function case's value may take between the child and the parent
VALUE_BYTES = 4 << 20
#: the deepest nesting of a returned value's tagged form the parent and the scorer accept
#: (the child's encoder stops at depth 200, each level at most two nestings)
VALUE_DEPTH = 450
#: the parent's exit status when it cannot protect itself (the sandbox's failure, not the code's;
#: the code cannot make the parent exit with it)
HARNESS_ERROR = 120


def prelude(recursion_limit: bool) -> str:
    lines = [f"from {m} import *" for m in (*PRELUDE_MODULES, "builtins", "typing")]
    lines += [f"import {m}" for m in PRELUDE_MODULES]
    if recursion_limit:
        lines.append(f"sys.setrecursionlimit({RECURSION_LIMIT})")
    return "\n".join(lines) + "\n"


#: prime stdin programs and SandboxFusion function cases: the code runs in the harness's process,
#: and what it prints is its answer (verl's meaning)
_RUNNER = r'''
import ast as _ast, json as _json, sys as _sys
_CODE, _FN, _FLAVOUR, _PRELUDE = __ARGS__


def _as_function(code):
    # prime_code's stdin programs: a trailing main guard unwrapped, the rest the body of code()
    try:
        tree = _ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, _ast.If) and _ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = _ast.unparse(tree.body[:-1]) + "\n" + _ast.unparse(last.body)
    except Exception:
        pass
    out, started = [], False
    for line in code.split("\n"):
        top = line.startswith("from ") or line.startswith("import ")
        if not top and not started:
            out.append("stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n")
            started = True
        out.append(("\t" if (started or not top) else "") + line + "\n")
    return "".join(out)


def _prime():
    module = {"__name__": "tmp_sol", "__builtins__": __builtins__}
    try:
        exec(compile(_PRELUDE + _as_function(_CODE), "<solution>", "exec"), module)
    except SystemExit:
        raise
    except BaseException as exc:
        _sys.stderr.write("compile error: %r\n" % (exc,))
        _sys.exit(3)
    if "code" not in module:
        _sys.stderr.write("no code to run\n")
        _sys.exit(3)
    try:
        module["code"]()
    except SystemExit:
        pass


def _sandbox_fusion():
    raw = _sys.stdin.read()
    module = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(_PRELUDE + _CODE, "<solution>", "exec"), module)
    try:
        if _FN in module:
            fn = module[_FN]
        elif "Solution" in module:
            fn = getattr(module["Solution"](), _FN)
        else:
            _sys.stderr.write("function %r not found\n" % (_FN,))
            return
        args = [_json.loads(line) for line in raw.split("\n")] if raw.strip() else []
        result = fn(*args)
    except Exception as exc:
        _sys.stderr.write("error in %r: %r\n" % (_FN, exc))
        return
    if isinstance(result, (dict, list, tuple)) or result is None or isinstance(result, bool):
        print(_json.dumps(result))
    else:
        print(str(result))


_prime() if _FLAVOUR == "prime" else _sandbox_fusion()
'''

#: the child's encoder, compiled only once the function has returned (so nothing the code did
#: before can have replaced it), with no builtins but the primitives captured before the code ran
_ENCODER = r'''
def enc(o, depth, B):
    type_, int_, float_, str_, repr_, isinstance_, bool_, list_, tuple_, dict_, Integral, Real = B
    if depth > 200:
        return {"__other__": "too deep"}
    if o is None or type_(o) is bool_ or type_(o) is str_:
        return o
    if isinstance_(o, bool_):
        return bool_(o)
    if isinstance_(o, Integral):
        return int_(o)
    if isinstance_(o, Real):
        f = float_(o)
        return f if f == f and f not in (float_("inf"), float_("-inf")) else {"__float__": repr_(f)}
    if isinstance_(o, str_):
        return str_(o)
    if type_(o) is list_:
        return [enc(x, depth + 1, B) for x in o]
    if type_(o) is tuple_:
        return {"__tuple__": [enc(x, depth + 1, B) for x in o]}
    if type_(o) is dict_:
        return {"__dict__": [[enc(k, depth + 1, B), enc(v, depth + 1, B)] for k, v in o.items()]}
    return {"__other__": str_(repr_(o))[:200]}
'''

#: prime function cases: a parent that never runs the code, a child that does (module doc)
_CALL_RUNNER = r'''
import json as _json, marshal as _marshal, numbers as _numbers, os as _os, select as _select
import signal as _signal, sys as _sys
_CODE, _FN, _PRELUDE, _ENCODER, _MAX_BYTES, _MAX_DEPTH, _HARNESS_ERROR = __ARGS__


def _args(raw):
    args = [_json.loads(line) for line in raw.split("\n")]
    try:
        if isinstance(args[0], dict):
            args = [{int(k): v for k, v in args[0].items()}]
    except Exception:
        pass
    return args


def _child(w, args):
    # everything the child needs once the code runs, taken now: the code can rebind any module
    # attribute or function, not these locals
    dumps, write, exit_, compile_, exec_ = _marshal.dumps, _os.write, _os._exit, compile, exec
    getattr_, len_, isinstance_, int_ = getattr, len, isinstance, int
    prims = (type, int, float, str, repr, isinstance, bool, list, tuple, dict, _numbers.Integral, _numbers.Real)
    encoder, code, fn_name, prelude = _ENCODER, _CODE, _FN, _PRELUDE
    flush = (_sys.stdout.flush, _sys.stderr.flush)
    _os.setpgid(0, 0)
    _os.dup2(2, 1)  # the code's prints go to stderr, which no verdict reads
    _os.closerange(3, w)
    _os.closerange(w + 1, 1 << 16)
    status = 1
    try:
        module = {"__name__": "tmp_sol", "__builtins__": __builtins__}
        try:
            exec_(compile_(prelude + code, "<solution>", "exec"), module)
        except SystemExit:
            raise
        except BaseException as exc:
            _sys.stderr.write("compile error: %r\n" % (exc,))
            status = 3
            return
        try:
            fn = getattr_(module["Solution"](), fn_name) if "class Solution" in code else module[fn_name]
        except Exception as exc:
            _sys.stderr.write("function %r not found: %r\n" % (fn_name, exc))
            status = 3
            return
        result = fn(*args)
        space = {"__builtins__": {}}
        exec_(compile_(encoder, "<encoder>", "exec"), space)
        data = dumps(space["enc"](result, 0, prims), 4)
        frame = len_(data).to_bytes(8, "big") + data
        sent = 0
        while sent < len_(frame):
            sent += write(w, frame[sent:])
        status = 0
    except SystemExit as exc:
        code_ = exc.code
        status = 0 if code_ is None else code_ & 0xFF if isinstance_(code_, int_) else 1
        status = 1 if status == 0 else status  # an exit is never a returned value
    except BaseException as exc:
        try:
            _sys.stderr.write("error in %r: %r\n" % (fn_name, exc))
        except BaseException:
            pass
    finally:
        for f in flush:
            try:
                f()
            except BaseException:
                pass
        exit_(status)


def _plain(value):
    # the child's value as data: plain types only, nesting bounded
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return False
        t = type(v)
        if v is None or t in (bool, int, float, str):
            continue
        if t is list:
            stack.extend((x, depth + 1) for x in v)
        elif t is dict:
            for k, x in v.items():
                if type(k) is not str:
                    return False
                stack.append((x, depth + 1))
        else:
            return False
    return True


def _fail(why, code=1):
    _sys.stderr.write("streamrl harness: %s\n" % why)
    _sys.stderr.flush()
    _os._exit(code)


def _main():
    exit_, fork = _os._exit, _os.fork
    raw = _sys.stdin.read()
    try:
        args = _args(raw)
    except Exception as exc:
        _fail("the case's input is not JSON lines: %r" % (exc,))
    try:  # PR_SET_DUMPABLE 0: the child cannot ptrace this process or open its /proc files
        import ctypes
        refused = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception as exc:
        refused = repr(exc)
    if refused:
        _fail("cannot make the harness non-dumpable (%s): not running the code" % (refused,), _HARNESS_ERROR)
    r, w = _os.pipe()
    _sys.stdout.flush()
    _sys.stderr.flush()
    pid = fork()
    if pid == 0:
        try:
            _child(w, args)
        finally:
            exit_(1)
    try:  # the child's group, set on both sides (whichever runs first)
        _os.setpgid(pid, pid)
    except OSError:
        pass
    _os.close(w)
    _os.set_blocking(r, False)
    data, eof = bytearray(), False
    while True:
        if not eof:
            _select.select([r], [], [], 0.05)
            while True:
                try:
                    chunk = _os.read(r, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    eof = True
                    break
                data += chunk
                if len(data) > _MAX_BYTES + 8:
                    _os.killpg(pid, _signal.SIGKILL)
                    _fail("the returned value is over %d bytes" % _MAX_BYTES)
        # exited, not yet reaped: its pid (the group's id) stays reserved while the group is killed
        ended = _os.waitid(_os.P_PID, pid, _os.WEXITED | _os.WNOWAIT | (0 if eof else _os.WNOHANG))
        if ended is not None:
            break
    try:  # what the child left behind (its process group) ends with it
        _os.killpg(pid, _signal.SIGKILL)
    except OSError:
        pass
    status = _os.waitpid(pid, 0)[1]
    while not eof:
        try:
            chunk = _os.read(r, 1 << 16)
        except BlockingIOError:
            break
        eof = not chunk
        data += chunk
    if _os.WIFSIGNALED(status):
        sig = _os.WTERMSIG(status)
        _sys.stderr.flush()
        _signal.signal(sig, _signal.SIG_DFL)
        _os.kill(_os.getpid(), sig)
        _fail("killed by signal %d" % sig)
    code_ = _os.WEXITSTATUS(status)
    if code_ != 0:
        _fail("the code did not return (exit status %d)" % code_, 3 if code_ == 3 else 1)
    if len(data) < 8 or int.from_bytes(data[:8], "big") != len(data) - 8:
        _fail("no single whole value came back (%d bytes)" % len(data))
    try:
        value = _marshal.loads(bytes(data[8:]))
    except Exception as exc:
        _fail("the value is not readable: %r" % (exc,))
    if not _plain(value):
        _fail("the value is not plain data")
    try:
        line = _json.dumps(value, allow_nan=False) + "\n"
    except Exception as exc:
        _fail("the value is not JSON: %r" % (exc,))
    out = line.encode()
    sent = 0
    while sent < len(out):
        sent += _os.write(1, out[sent:])
    exit_(0)


_main()
'''


def program(code: str, fn_name: str | None, flavour: str) -> str:
    """The harness around ``code`` (``flavour``: prime | sandbox_fusion). A stdin case of the
    sandbox_fusion flavour is the code itself, as verl sends it."""
    if flavour == "sandbox_fusion" and fn_name is None:
        return code
    pre = prelude(recursion_limit=flavour == "prime")
    if flavour == "prime" and fn_name is not None:
        args = repr((code, fn_name, pre, _ENCODER, VALUE_BYTES, VALUE_DEPTH, HARNESS_ERROR))
        return _CALL_RUNNER.replace("__ARGS__", args, 1)
    return _RUNNER.replace("__ARGS__", repr((code, fn_name, flavour, pre)), 1)


class Opaque:
    """A returned value that was not plain data (``__other__``): equal to nothing."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"<opaque {self.text}>"


def decode(value: Any) -> Any:
    """The harness's tagged JSON back to Python values (tuples, dicts with their key types)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {_key(decode(k)): decode(v) for k, v in value["__dict__"]}
        if "__float__" in value:
            return float(value["__float__"])
        return Opaque(str(value.get("__other__", "")))
    return value


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def returned(stdout: str) -> tuple[bool, Any]:
    """The function's return value from a prime function case's run (its parent exited 0):
    ``(found, value)``. stdout must be exactly the parent's one JSON line; anything else is not
    found (a fail)."""
    if not stdout.endswith("\n") or "\n" in stdout[:-1] or len(stdout) > 2 * VALUE_BYTES:
        return False, None
    try:
        value = json.loads(stdout)
        # byte for byte the parent's line: not a space or a byte more (module doc, point 4)
        if json.dumps(value, allow_nan=False) + "\n" != stdout or not _shallow(value):
            return False, None
        return True, decode(value)
    except (ValueError, TypeError, KeyError, RecursionError):
        return False, None


def _shallow(value: Any) -> bool:
    """Nesting within ``VALUE_DEPTH`` (checked without recursion, before ``decode`` recurses)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > VALUE_DEPTH:
            return False
        if isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
    return True
