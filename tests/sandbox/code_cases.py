"""Generated code problems and responses for the parity tests: both of verl's test-case formats
(stdin / stdout pairs, ``fn_name`` function calls; ``assert_case`` for the SandboxFusion path), and
responses that are correct, wrong, slow, crashing, or correct in a way only one of verl's
comparisons accepts (floats, padding, exit codes, tuples, int dict keys, ``global``, no fence)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

FENCE = "```"


@dataclass(frozen=True)
class Case:
    name: str
    response: str
    ground_truth: str


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n{FENCE}{tag}\n{code}\n{FENCE}\nDone."


def _sum_table(rng: random.Random, n: int) -> dict:
    inputs, outputs = [], []
    for _ in range(n):
        xs = [rng.randint(-50, 50) for _ in range(rng.randint(1, 6))]
        inputs.append(f"{len(xs)}\n{' '.join(map(str, xs))}\n")
        outputs.append(f"{sum(xs)}\n")
    return {"inputs": inputs, "outputs": outputs}


_READ = "n = int(input())\nxs = list(map(int, input().split()))\n"
SUM_SOLUTIONS = {
    "correct": _READ + "print(sum(xs))",
    "wrong": _READ + "print(sum(xs) + 1)",
    "crash": _READ + "print(xs[n])",
    "float": _READ + "print(float(sum(xs)))",
    "padded": _READ + "print('  ' + str(sum(xs)) + '  ')\nprint()",
    "exit_1_after": "import sys\n" + _READ + "print(sum(xs))\nsys.exit(1)",
    "global": "total = 0\ndef add(v):\n    global total\n    total += v\n" + _READ + "for v in xs:\n    add(v)\nprint(total)",
    "main_guard": "def main():\n" + "".join("    " + line + "\n" for line in _READ.splitlines())
                  + "    print(sum(xs))\n\nif __name__ == '__main__':\n    main()",
    "syntax_error": _READ + "print(sum(xs)",
    "slow": "import time\ntime.sleep(30)\n" + _READ + "print(sum(xs))",
}

ADD_SOLUTIONS = {
    "correct": "def add(a, b):\n    return a + b",
    "wrong": "def add(a, b):\n    return a * b",
    "tuple": "def add(a, b):\n    return (a + b,)",
    "wrapped": "def add(a, b):\n    return [a + b]",
    "class": "class Solution:\n    def add(self, a, b):\n        return a + b",
    "crash": "def add(a, b):\n    return a // 0",
    "missing": "def plus(a, b):\n    return a + b",
    "prints": "def add(a, b):\n    print('thinking')\n    return a + b",
}

COUNT_SOLUTIONS = {
    "correct": "def count(xs):\n    out = {}\n    for x in xs:\n        out[x] = out.get(x, 0) + 1\n    return out",
    "str_keys": "def count(xs):\n    out = {}\n    for x in xs:\n        out[str(x)] = out.get(str(x), 0) + 1\n    return out",
    "pairs": "def count(xs):\n    return sorted((x, xs.count(x)) for x in set(xs))",
}


def cases(seed: int = 0, *, slow: bool = True) -> list[Case]:
    """The parity set: every solution of every problem, with generated test cases."""
    rng = random.Random(seed)
    out = []
    table = _sum_table(rng, 3)
    for name, code in SUM_SOLUTIONS.items():
        if name == "slow":
            if slow:
                out.append(Case("sum/slow", fenced(code), json.dumps(_sum_table(rng, 2))))
            continue
        out.append(Case(f"sum/{name}", fenced(code), json.dumps(table)))
    # twelve cases, some wrong: verl's continuous score reads the first 10
    out.append(Case("sum/wrong_on_some", fenced(_READ + "print(sum(xs) if n % 2 else sum(xs) - 1)"),
                    json.dumps(_sum_table(rng, 12))))
    out.append(Case("sum/unfenced", _READ + "print(sum(xs))", json.dumps(table)))
    out.append(Case("sum/plain_fence", fenced(_READ + "print(sum(xs))", tag=""), json.dumps(table)))
    add_inputs, add_outputs = [], []
    for _ in range(3):
        a, b = rng.randint(-99, 99), rng.randint(-99, 99)
        add_inputs.append(f"{a}\n{b}")
        add_outputs.append(json.dumps(a + b))
    add = json.dumps({"fn_name": "add", "inputs": add_inputs, "outputs": add_outputs})
    for name, code in ADD_SOLUTIONS.items():
        out.append(Case(f"add/{name}", fenced(code), add))
    count_inputs, count_outputs = [], []
    for _ in range(2):
        xs = [rng.randint(1, 3) for _ in range(rng.randint(1, 5))]
        counts: dict[int, int] = {}
        for x in xs:
            counts[x] = counts.get(x, 0) + 1
        count_inputs.append(json.dumps(xs))
        count_outputs.append(json.dumps(counts))
    count = json.dumps({"fn_name": "count", "inputs": count_inputs, "outputs": count_outputs})
    for name, code in COUNT_SOLUTIONS.items():
        out.append(Case(f"count/{name}", fenced(code), count))
    return out


def assert_cases() -> list[Case]:
    """SandboxFusion's ``assert_case`` rows: the code plus an assert, empty stdin."""
    table = json.dumps({"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]})
    return [Case(f"assert/{name}", fenced(code), table) for name, code in ADD_SOLUTIONS.items()]
