"""streamrl's import graph, drawn from the code with ``ast`` (nothing is imported), by the checks
of ``tests/project/test_imports.py``:

    python tools/import_graph.py                 # the numbers: modules, packages, floors, arrows
    python tools/import_graph.py --floors        # and each floor's packages, bottom first
    python tools/import_graph.py --dot > g.dot   # Graphviz, one node per package (dot -Tsvg g.dot)
    python tools/import_graph.py --root ../main  # another checkout (its code and its layers table)

A node is a module directly under ``streamrl/`` or a subpackage with all it holds; an arrow, any
import of one by the other (lazy ones inside functions counted, as a reader follows them). A
package's floor is one above the highest it imports (0: it imports nothing of streamrl). The
layers are the "Layers" table of ``docs/development/layout.md``; an arrow up is a module-level
import from a module to one in a higher layer. Exit status 1 when there is a circle or an arrow up.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def checks(root: Path, layers: Path | None = None):
    """``tests/project/test_imports.py`` of this checkout, pointed at ``root``'s package and the
    layers table of ``layers`` (a checkout; ``root`` unless given)."""
    spec = importlib.util.spec_from_file_location("streamrl_import_checks", HERE / "tests" / "project" / "test_imports.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    mod.PACKAGE = (layers or root) / "streamrl"
    mod.LAYERS = mod.read_layers()
    mod.PACKAGE = root / "streamrl"
    return mod


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=HERE, help="a streamrl checkout (default: this one)")
    parser.add_argument("--layers", type=Path, help="the checkout whose layers table to hold the code to (default: --root)")
    parser.add_argument("--floors", action="store_true", help="list each floor's packages")
    parser.add_argument("--dot", action="store_true", help="print the package graph in Graphviz's language")
    args = parser.parse_args(argv)
    c = checks(args.root.resolve(), args.layers.resolve() if args.layers else None)
    mods = c.sources()
    every = c.import_graph(mods)
    module_level = c.import_graph(mods, c.module_level_imports)
    packages = c.package_graph(every)
    floor = c.floors(packages)
    tangles = c.components(packages)
    module_circles = c.cycles(every)
    unplaced = sorted(m for m in mods if c.layer_of(m) is None)
    up = sorted(c.upward_imports({a: t for a, t in module_level.items() if a not in unplaced}))
    if args.dot:
        print("digraph streamrl {\n  rankdir=BT;\n  node [shape=box, fontname=monospace];")
        for f in sorted(set(floor.values())):
            names = " ".join(f'"{n}";' for n in sorted(n for n in floor if floor[n] == f))
            print(f"  {{ rank=same; {names} }}")
        for a in sorted(packages):
            for b in sorted(packages[a]):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return 1 if tangles or module_circles or up else 0
    print(f"{len(mods)} modules in {len(packages)} packages and modules on {max(floor.values()) + 1} floors; "
          f"{sum(len(t) for t in packages.values())} arrows between them "
          f"({sum(len(t) for t in c.package_graph(module_level).values())} at module level); "
          f"{sum(len(t) for t in every.values())} between modules")
    if args.floors:
        for f in sorted(set(floor.values())):
            print(f"  floor {f}: " + ", ".join(sorted(n.removeprefix("streamrl.") or "streamrl" for n in floor if floor[n] == f)))
    print(f"packages in circles: {len(tangles)}")
    for tangle in tangles:
        print("  " + ", ".join(sorted(tangle)) + ", by:")
        for a in sorted(every):
            for b in sorted(every[a]):
                if c.package_of(a) in tangle and c.package_of(b) in tangle and c.package_of(a) != c.package_of(b):
                    print(f"    {a} -> {b}" + ("" if b in module_level[a] else " (inside a function)"))
    print(f"modules in circles: {len(module_circles)}" + "".join(f"\n  {' -> '.join(m)}" for m in module_circles))
    names = [name for name, _ in c.LAYERS]
    print(f"arrows up the layers of docs/development/layout.md: {len(up)}"
          + "".join(f"\n  {a} ({names[c.layer_of(a)]}) -> {b} ({names[c.layer_of(b)]})" for a, b in up))
    if unplaced:
        print(f"modules in no layer: {', '.join(unplaced)}")
    return 1 if tangles or module_circles or up else 0


if __name__ == "__main__":
    sys.exit(main())
