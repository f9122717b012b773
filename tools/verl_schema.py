"""Record verl's schema (every leaf of the installed verl's generated trainer configs, per
engine, with its default) as ``streamrl/verl/schema_data.py``.

    python tools/verl_schema.py            # rewrite the data from the installed verl
    python tools/verl_schema.py --check    # exit 1 when the recorded data differs from it

Key names and default values are facts about verl's configuration; no verl file is copied.
Run it after upgrading verl, then give every new key a row (tests/verl/test_verl_schema.py
says which have none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamrl.verl.schema import read_installed_verl  # noqa: E402

TARGET = ROOT / "streamrl" / "verl" / "schema_data.py"


def render(version: str, engines: dict[str, dict[str, Any]]) -> str:
    """The data module's text: the keys every engine has with one default, then each engine's own."""
    names = list(engines)
    everywhere = set.intersection(*(set(keys) for keys in engines.values()))
    shared = {k: engines[names[0]][k] for k in sorted(everywhere)
              if all(_same(engines[e][k], engines[names[0]][k]) for e in names)}
    lines = ['"""verl\'s schema, recorded from the installed verl by tools/verl_schema.py: do not edit by hand.',
             "",
             "``SHARED``: the keys every engine has, with the same default; ``BY_ENGINE``: the rest, per engine",
             "(``model_engine``). ``???`` is verl's mandatory value (no default).", '"""', "",
             "from typing import Any", "", f"VERL_VERSION = {version!r}", f"ENGINES = {tuple(names)!r}", "",
             "SHARED: dict[str, Any] = {"]
    lines += [f"    {k!r}: {shared[k]!r}," for k in shared]
    lines += ["}", "", "BY_ENGINE: dict[str, dict[str, Any]] = {"]
    for engine in names:
        lines.append(f"    {engine!r}: {{")
        lines += [f"        {k!r}: {v!r}," for k, v in sorted(engines[engine].items()) if k not in shared]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    text = render(*read_installed_verl())
    if args.check:
        same = TARGET.exists() and TARGET.read_text() == text
        print("the recorded schema is the installed verl's" if same else f"{TARGET} differs from the installed verl's")
        return 0 if same else 1
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
