"""The package's import structure, read with ``ast`` (nothing is imported):

- the Kafka client is imported by ``streamrl/bus/kafka.py`` (and the benchmark's baseline,
  ``streamrl/bench/bare_clients.py``) only, so replacing it is a change to one module;
- nothing outside the bus reaches into a client (``.client``);
- streamrl's modules import each other without circles, counting imports inside functions
  (a circle hidden in a function still breaks whichever module is imported first);
- at module level (imports inside functions, lazy by design, left out; those under ``if
  TYPE_CHECKING`` counted: a reader follows them) every module sits in a layer (``LAYERS``) and
  imports only from its own or lower ones: no arrow runs back up;
- drawn one node per package (a module directly under ``streamrl/``, or a subpackage with all it
  holds), the imports, lazy ones included, have no circle either: a reader of ``feed/`` never has
  to open ``rollout/`` or ``learner/``, and the packages stand on floors (``floors``).

``python tools/import_graph.py`` draws the same graph and prints its numbers (modules, packages,
floors, arrows), its circles and the arrows that run up; ``--dot`` for Graphviz.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "streamrl"
KAFKA_CLIENTS = {"aiokafka", "kafka", "confluent_kafka"}
KAFKA_ALLOWED = {"streamrl/bus/kafka.py", "streamrl/bench/bare_clients.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package: name -> (path, syntax tree)."""
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(tree: ast.Module, *, in_functions: bool = True, type_checking: bool = True) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (``in_functions=False``: not inside a function),
    those under ``if TYPE_CHECKING`` included unless ``type_checking=False``: they never run,
    but they are what a reader follows to know what a module works on (issue 41)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not in_functions and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child)

    visit(tree)
    return out


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement names (``from X import y``: ``X.y`` and
    ``X``; the caller keeps whichever is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(mods: dict[str, tuple[Path, ast.Module]], find=None) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports (by the statements ``find`` returns: ``imports``
    unless given)."""
    find = find or imports
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, (path, tree) in mods.items():
        is_package = path.name == "__init__.py"
        for node in find(tree):
            names = imported_names(node, name, is_package)
            if isinstance(node, ast.ImportFrom):
                # ``from X import y``: the module X.y if there is one, else X itself
                submodules = [n for n in names[:-1] if n in mods]
                targets = submodules if len(submodules) == len(names) - 1 else submodules + [names[-1]]
            else:
                targets = names
            for target in targets:
                while target and target not in mods:  # ``import a.b.c`` where c is not a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (each holds a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component."""
    out = []
    for component in components(graph):
        start = min(component)
        paths = {start: [start]}
        todo = [start]
        while todo:  # breadth first inside the component, back to the start
            v = todo.pop(0)
            for w in sorted(graph[v] & component):
                if w == start:
                    out.append(paths[v] + [start])
                    todo = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    todo.append(w)
    return sorted(out)


def test_only_the_kafka_transport_imports_a_kafka_client():
    found = []
    for path, tree in sources().values():
        rel = str(path.relative_to(PACKAGE.parent))
        if rel in KAFKA_ALLOWED:
            continue
        for node in imports(tree):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            for root in roots:
                if root.split(".")[0] in KAFKA_CLIENTS:
                    found.append(f"{where(path, node)}: import {root}")
    assert not found, "Kafka clients imported outside streamrl/bus/kafka.py:\n" + "\n".join(found)


def test_nothing_outside_the_bus_reaches_into_a_client():
    found = []
    for name, (path, tree) in sources().items():
        if name == "streamrl.bus" or name.startswith("streamrl.bus."):
            continue
        found += [f"{where(path, node)}: .{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr == "client"]
    assert not found, "raw client reached outside the bus (add what it needs to the bus):\n" + "\n".join(found)


def test_the_circle_check_sees_every_form_of_import():
    """The checker itself, on a made-up package: function-level, relative, ``from pkg import
    module`` and ``if TYPE_CHECKING`` imports are edges."""
    code = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "A = 1\ndef f():\n    from .sub import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from pkg import c\n",
        "pkg/c.py": "import pkg.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "from pkg.c import x, y\n",
    }
    mods = {name: (Path(path), ast.parse(text)) for path, text in code.items()
            for name in [path[:-3].replace("/__init__", "").replace("/", ".")]}
    graph = import_graph(mods)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a", "pkg.d"}, "pkg.d": {"pkg.c"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    running = import_graph(mods, lambda tree: imports(tree, type_checking=False))
    assert running["pkg.c"] == {"pkg.a"}  # what runs, for the checks that ask that


def package_of(module: str) -> str:
    """The node a module is drawn in: itself if directly under ``streamrl/``, else its package
    there (``streamrl.rollout.backends.vllm_engine`` -> ``streamrl.rollout``)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph drawn one node per package: an arrow where any module of one imports
    any module of the other."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(package_of(a), set()).update(package_of(b) for b in targets if package_of(b) != package_of(a))
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 0 for one that imports nothing, else one above the highest it imports
    (the nodes of a circle share one floor, as if one node)."""
    merged = {v: min(c) for c in components(graph) for v in c}
    rep = {v: merged.get(v, v) for v in graph}
    dag: dict[str, set[str]] = {}
    for a, targets in graph.items():
        dag.setdefault(rep[a], set()).update(rep[b] for b in targets if rep[b] != rep[a])
    floor: dict[str, int] = {}

    def climb(v: str) -> int:
        if v not in floor:
            floor[v] = 1 + max((climb(w) for w in dag[v]), default=-1)
        return floor[v]

    return {v: climb(rep[v]) for v in graph}


def test_the_package_drawing_sees_a_circle_between_packages():
    """On a made-up graph: two packages whose modules import each other's (no module circle)
    are one circle when drawn by package; floors count up from what imports nothing."""
    graph = {"streamrl.feed.prompts": {"streamrl.rollout.chat"}, "streamrl.rollout.chat": set(),
             "streamrl.rollout.worker": {"streamrl.feed.config", "streamrl.errors"}, "streamrl.feed.config": set(),
             "streamrl.errors": set()}
    assert not cycles(graph)
    packages = package_graph(graph)
    assert packages == {"streamrl.feed": {"streamrl.rollout"}, "streamrl.rollout": {"streamrl.feed", "streamrl.errors"},
                        "streamrl.errors": set()}
    assert cycles(packages) == [["streamrl.feed", "streamrl.rollout", "streamrl.feed"]]
    assert floors(packages) == {"streamrl.errors": 0, "streamrl.feed": 1, "streamrl.rollout": 1}
    del graph["streamrl.feed.prompts"]
    assert floors(package_graph(graph)) == {"streamrl.errors": 0, "streamrl.feed": 0, "streamrl.rollout": 1}


def test_packages_import_each_other_without_circles():
    """Drawn one node per package, every import counted (lazy ones too: a reader follows them,
    and a process that runs them loads the other package), the graph has no circle: what two
    packages share lives in a module below both (``streamrl.chat``, ``streamrl.resume``)."""
    found = cycles(package_graph(import_graph(sources())))
    assert not found, "packages that import each other (give what they share a home below both):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_no_import_circles():
    found = cycles(import_graph(sources()))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


#: streamrl's layers, bottom first: read from the "Layers" table of docs/development/layout.md
#: (the doc a newcomer reads is the one the test holds to the code).
def read_layers() -> list[tuple[str, tuple[str, ...]]]:
    text = (PACKAGE.parent / "docs" / "development" / "layout.md").read_text()
    table = text[text.index("## Layers"):]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| layer |", "| ---"))]
    return [(name.strip(), tuple(re.findall(r"`([^`]+)`", patterns)))
            for name, patterns in (row.strip("| ").split(" | ", 1) for row in rows)]


LAYERS: list[tuple[str, tuple[str, ...]]] = read_layers()

#: Imports that still run up a layer, each removed by the work named beside it; the lead empties
#: this set when those branches merge (an entry no longer found fails the test, so it cannot go stale).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a reader of the module follows: at module level, those under ``if
    TYPE_CHECKING`` included, not those inside a function (lazy, by design: heavy extras, the
    CLI's fast ``--help``)."""
    return imports(tree, in_functions=False)


def layer_of(module: str) -> int | None:
    from fnmatch import fnmatchcase

    return next((i for i, (_, patterns) in enumerate(LAYERS) for p in patterns if fnmatchcase(module, p)), None)


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)}  # type: ignore[operator]


def test_the_layer_check_sees_an_import_that_runs_up():
    """On a made-up graph: a stage (or a stage config) importing the pipeline config is caught,
    the pipeline config importing a stage's config is not."""
    assert layer_of("streamrl.reward.config") < layer_of("streamrl.reward.stage") < layer_of("streamrl.pipeline_config")
    graph = {"streamrl.pipeline_config": {"streamrl.reward.config", "streamrl.config"},
             "streamrl.reward.config": {"streamrl.pipeline_config"}, "streamrl.config": set(),
             "streamrl.reward.stage": {"streamrl.pipeline_config", "streamrl.reward.config"}}
    assert upward_imports(graph) == {("streamrl.reward.config", "streamrl.pipeline_config"),
                                     ("streamrl.reward.stage", "streamrl.pipeline_config")}


def test_every_module_has_a_layer_and_imports_only_down():
    """The package's module-level import graph (``ast``; ``if TYPE_CHECKING`` imports counted,
    imports inside functions left out, see ``module_level_imports``) has no circle, and no module
    imports from a layer above its own (``LAYERS``): the shared config machinery sits below the
    stages, each stage's config below the pipeline config that composes them, the stages below
    the runtime and the CLI that run them."""
    mods = sources()
    unplaced = sorted(m for m in mods if layer_of(m) is None)
    assert not unplaced, "modules in no layer (add each to LAYERS in tests/project/test_imports.py):\n" + "\n".join(unplaced)
    graph = import_graph(mods, module_level_imports)
    found = cycles(graph)
    assert not found, "import circles at module level:\n" + "\n".join(" -> ".join(c) for c in found)
    up = upward_imports(graph)
    stale = KNOWN_UPWARD - up
    assert not stale, f"KNOWN_UPWARD lists imports that are gone (remove them): {sorted(stale)}"
    new = sorted(up - KNOWN_UPWARD)
    names = [name for name, _ in LAYERS]
    assert not new, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"{a} ({names[layer_of(a)]}) -> {b} ({names[layer_of(b)]})" for a, b in new)  # type: ignore[index]


def test_per_record_outcomes_are_not_user_errors():
    """A record's failure is dead-lettered by its stage; were one to escape, it must not pass for
    a user error (exit 2, 'change your config'). Scorer authors' names are the same classes."""
    from streamrl.errors import Failure, RecordOutcome, StreamrlError, Unavailable
    from streamrl.records import RecordError
    from streamrl.scorers import ScoreError, ScorerUnavailable

    for cls in (Failure, Unavailable, RecordError):
        assert issubclass(cls, RecordOutcome) and not issubclass(cls, StreamrlError)
    assert ScoreError is Failure and ScorerUnavailable is Unavailable


def test_no_test_module_imports_another():
    """What several test files share lives in ``tests/helpers.py`` (or ``math_pairs``, ``deploy``,
    fixtures in ``conftest.py``): importing a test module runs its module-level code and ties
    two test files' bodies together. Every import at any depth counts."""
    tests = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                f"{node.module or ''}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if any(part.startswith("test_") for part in parts):  # test_x, tests.test_x, tests.bus.test_x
                    found.append(f"{path.relative_to(tests.parent)}:{node.lineno}: {name}")
    assert not found, "test modules imported by other files (move what they share to tests/helpers.py):\n" + \
        "\n".join(found)


def test_no_undefined_names_in_the_package_tests_or_services():
    """ruff's pyflakes rules over every file: an undefined name is a NameError waiting on a code
    path the suite may not run (a misplaced import once broke ``streamrl bench learner --nproc``);
    names used only in string annotations are fine when imported under ``TYPE_CHECKING``. (`make
    test` runs the whole rule set of ``[tool.ruff]`` first; this one stays in the suite.)"""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    ruff = Path(sys.executable).with_name("ruff")
    found = subprocess.run([str(ruff), "check", "--select", "F821,F822,F823", "--output-format", "concise",
                            "streamrl", "tests", "services"], cwd=root, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_graph_tool_draws_this_graph(tmp_path):
    """``python tools/import_graph.py``, the command the layout page gives, prints this tree's
    numbers and exits 0; pointed at a tree with a circle between packages it names the imports
    that close it and exits 1."""
    import shutil
    import subprocess
    import sys

    root = PACKAGE.parent
    tool = root / "tools" / "import_graph.py"
    out = subprocess.run([sys.executable, str(tool), "--floors"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    packages = package_graph(import_graph(sources()))
    assert f"{len(sources())} modules in {len(packages)} packages and modules on {max(floors(packages).values()) + 1} floors" \
        in out.stdout
    assert "packages in circles: 0" in out.stdout and "arrows up the layers of docs/development/layout.md: 0" in out.stdout
    other = tmp_path / "other"
    shutil.copytree(root / "streamrl", other / "streamrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "docs" / "development", other / "docs" / "development")
    feed = other / "streamrl" / "feed" / "stage.py"
    feed.write_text("from streamrl.rollout.worker import RolloutWorker\n" + feed.read_text())
    out = subprocess.run([sys.executable, str(tool), "--root", str(other)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "streamrl.feed.stage -> streamrl.rollout.worker" in out.stdout and "packages in circles: 1" in out.stdout
