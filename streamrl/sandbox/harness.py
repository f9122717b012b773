"""The program a test case runs in the sandbox: the response's code, wrapped the way verl's two
code scorers run it, and (for a function-call case) its return value written out as data.

verl scores code two ways, and a case means a slightly different thing in each:

- ``prime`` (verl's ``prime_code``, no sandbox URL): the code is compiled as a module named
  ``tmp_sol`` after a prelude of standard-library imports and a raised recursion limit; a trailing
  ``if __name__ == '__main__':`` block is unwrapped; ``sys.exit`` ends a stdin program normally;
  a function case calls ``fn_name`` on the module (on ``Solution()`` when the code defines
  ``class Solution``) with one JSON value per input line. The return value is compared by the
  scorer, outside the sandbox: the harness writes it after a per-execution random marker as
  tagged JSON (tuples, dict keys, other types kept apart), so code cannot forge a pass by
  printing, nor by returning an object whose ``__eq__`` lies.
- ``sandbox_fusion`` (verl's SandboxFusion client): a stdin case runs the code itself; a function
  case runs it as the main module after the same import prelude, calls ``fn_name`` from its globals
  (else ``Solution().fn_name``) and prints the result as verl's wrapper prints it (JSON for
  containers, ``None`` and bools, ``str`` otherwise); stdout is compared with the expected output.
"""

from __future__ import annotations

import json
from typing import Any

#: the standard-library modules both of verl's runners import, ``*`` and by name, before the code
PRELUDE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                   "statistics", "itertools", "functools", "operator", "io", "sys", "json")
RECURSION_LIMIT = 6 * 10**5  # prime_code's


def prelude(recursion_limit: bool) -> str:
    lines = [f"from {m} import *" for m in (*PRELUDE_MODULES, "builtins", "typing")]
    lines += [f"import {m}" for m in PRELUDE_MODULES]
    if recursion_limit:
        lines.append(f"sys.setrecursionlimit({RECURSION_LIMIT})")
    return "\n".join(lines) + "\n"


_RUNNER = r'''
import ast as _ast, json as _json, numbers as _numbers, sys as _sys
_CODE, _FN, _MARK, _FLAVOUR, _PRELUDE = __ARGS__


def _enc(o, depth=0):
    if depth > 200:
        return {"__other__": "too deep"}
    if o is None or type(o) in (bool, str):
        return o
    if isinstance(o, bool):
        return bool(o)
    if isinstance(o, _numbers.Integral):
        return int(o)
    if isinstance(o, _numbers.Real):
        f = float(o)
        return f if f == f and f not in (float("inf"), float("-inf")) else {"__float__": repr(f)}
    if isinstance(o, str):
        return str(o)
    if type(o) is list:
        return [_enc(x, depth + 1) for x in o]
    if type(o) is tuple:
        return {"__tuple__": [_enc(x, depth + 1) for x in o]}
    if type(o) is dict:
        return {"__dict__": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in o.items()]}
    return {"__other__": repr(o)[:200]}


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


def _args(raw):
    args = [_json.loads(line) for line in raw.split("\n")]
    try:
        if isinstance(args[0], dict):
            args = [{int(k): v for k, v in args[0].items()}]
    except Exception:
        pass
    return args


def _load(source, name):
    module = {"__name__": name, "__builtins__": __builtins__}
    try:
        exec(compile(source, "<solution>", "exec"), module)
    except SystemExit:
        raise
    except BaseException as exc:
        _sys.stderr.write("compile error: %r\n" % (exc,))
        _sys.exit(3)
    return module


def _prime():
    if _FN is None:
        module = _load(_PRELUDE + _as_function(_CODE), "tmp_sol")
        if "code" not in module:
            _sys.stderr.write("no code to run\n")
            _sys.exit(3)
        try:
            module["code"]()
        except SystemExit:
            pass
        return
    raw = _sys.stdin.read()
    module = _load(_PRELUDE + _CODE, "tmp_sol")
    try:
        fn = getattr(module["Solution"](), _FN) if "class Solution" in _CODE else module[_FN]
    except Exception as exc:
        _sys.stderr.write("function %r not found: %r\n" % (_FN, exc))
        _sys.exit(3)
    result = fn(*_args(raw))
    _sys.stdout.flush()
    _sys.stdout.write("\n" + _MARK + _json.dumps(_enc(result)) + "\n")


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


def program(code: str, fn_name: str | None, flavour: str, mark: str = "") -> str:
    """The harness around ``code`` (``flavour``: prime | sandbox_fusion). A stdin case of the
    sandbox_fusion flavour is the code itself, as verl sends it."""
    if flavour == "sandbox_fusion" and fn_name is None:
        return code
    pre = prelude(recursion_limit=flavour == "prime")
    args = repr((code, fn_name, mark, flavour, pre))
    return _RUNNER.replace("__ARGS__", args, 1)


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


def returned(stdout: str, mark: str) -> tuple[bool, Any]:
    """The function's return value from a prime-flavour run's stdout: ``(found, value)``."""
    at = stdout.rfind("\n" + mark)
    if at < 0:
        return False, None
    line = stdout[at + 1 + len(mark):].split("\n", 1)[0]
    try:
        return True, decode(json.loads(line))
    except (ValueError, TypeError, KeyError):
        return False, None
