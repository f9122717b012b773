"""The docs site's reference pages, generated from the code at build time (``docs/hooks.py``
adds them to the site; ``python docs/reference_pages.py OUT`` writes them to OUT to read, and
lists the configuration keys that have no comment).

- **Configuration**: one page per section of ``PipelineConfig`` (walked field by field, so a
  section, key or sub-section added, renamed or removed in code changes the page): every key
  with its type, default and documentation. A key's documentation is the ``#`` comment on its
  line and the comment lines directly above it (a ``# -- heading --`` line is a heading, not
  documentation); a section's is its class docstring. ``undocumented_keys()`` lists the keys
  without one, and ``tests/project/test_docs.py`` fails on any.
- **CLI**: every verb's ``--help`` (and its sub-verbs'), from the argparse parsers the
  ``streamrl`` command builds (``streamrl.cli.build_parser``).
- **Metrics**: every Prometheus metric ``streamrl.metrics`` declares, under its section.

Nothing here is part of the package: it reads the package.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import os
import re
import sys
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent

#: where the generated pages go in the site
CONFIG_DIR = "reference/config"
CLI_PAGE = "reference/cli.md"
METRICS_PAGE = "reference/metrics.md"
SNIPPETS = "_snippets"  # the key of the snippets in --json's output (not a page)

#: free-form mappings (``dict[str, Any]`` in their dataclass) whose keys another dataclass
#: checks when the stage starts: documented as that dataclass's section
FREE_FORM_SECTIONS = {
    "reward.scorers.<name>.judge": ("streamrl.scorers.judge", "JudgeConfig"),
    "reward.scorers.<name>.model": ("streamrl.scorers.model.config", "ModelScorerConfig"),
}

_HEADING = re.compile(r"^#\s*--")


# -- configuration ------------------------------------------------------------------------------

@dataclass
class Key:
    """One configuration key: its dotted path, type as written, default as YAML writes it, and
    documentation."""

    path: str
    type: str
    default: str
    doc: str


@dataclass
class Section:
    """A dataclass of the config at ``path`` (``learner``, ``learner.parallel``,
    ``reward.scorers.<name>``), its docstring, scalar keys and sub-sections."""

    path: str
    cls: type
    doc: str
    keys: list[Key] = field(default_factory=list)
    sections: list["Section"] = field(default_factory=list)
    #: as the field that holds it is declared (empty for a top-level section)
    type: str = ""
    default: str = ""

    def walk(self) -> Iterator["Section"]:
        yield self
        for sub in self.sections:
            yield from sub.walk()


@functools.lru_cache(maxsize=None)
def _parsed(path: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    """A source file's tree, its end-of-line comments by line, and its lines."""
    source = Path(path).read_text()
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] in code_lines:
                comments[tok.start[0]] = tok.string
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return ast.parse(source), comments, source.splitlines()


def _comment_text(comment: str) -> str:
    return re.sub(r"^#:?\s?", "", comment.strip()).strip()


def _class_node(cls: type) -> tuple[ast.ClassDef, dict[int, str], list[str]] | None:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if not path:
        return None
    tree, comments, lines = _parsed(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, comments, lines
    return None


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` (inherited ones too) -> its comment: the comment lines
    directly above it, then the one at the end of its line; "" when it has none."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        found = _class_node(klass) if dataclasses.is_dataclass(klass) else None
        if found is None:
            continue
        node, comments, lines = found
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#") and not _HEADING.match(lines[i].strip()):
                above.insert(0, _comment_text(lines[i]))
                i -= 1
            trailing = comments.get(stmt.end_lineno or stmt.lineno, "")
            docs[stmt.target.id] = " ".join(p for p in [*above, _comment_text(trailing)] if p)
    return docs


def class_doc(cls: type) -> str:
    """The class's own docstring (not the signature dataclasses make up without one)."""
    found = _class_node(cls)
    return inspect.cleandoc(ast.get_docstring(found[0]) or "") if found else ""


def _type_text(cls: type, name: str) -> str:
    """The annotation as the source writes it."""
    annotation = cls.__dataclass_fields__[name].type
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _yaml(value: Any) -> str:
    """A default as a config file writes it."""
    if value is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, dict) and any(dataclasses.is_dataclass(v) for v in value.values()):
        return "{" + ", ".join(f"{k}: ..." for k in value) + "}"
    if isinstance(value, float) and value == int(value) and abs(value) < 1e15:
        return f"{value:.1f}"
    return json.dumps(value)


def _dataclass_in(hint: Any) -> tuple[str, type] | None:
    """``("", C)`` for a dataclass ``C`` (or ``Optional[C]``), ``("<name>", C)`` for
    ``dict[str, C]``, ``("[]", C)`` for ``list[C]``; None for anything else."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return "", hint
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        return _dataclass_in(inner[0]) if len(inner) == 1 else None
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return ".<name>", args[1]
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return "[]", args[0]
    return None


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types, resolved where they can be (a name only imported for type checkers
    stays a string: documented as written, not walked)."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        out = {}
        for f in dataclasses.fields(cls):
            try:
                out[f.name] = typing.get_type_hints(type("_", (), {"__annotations__": {f.name: f.type},
                                                                 "__module__": cls.__module__}))[f.name]
            except NameError:
                out[f.name] = f.type
        return out


def section(cls: type, path: str) -> Section:
    """The section of dataclass ``cls`` at ``path``, with its sub-sections, walked from the
    type hints (so a section added anywhere below appears)."""
    out = Section(path, cls, class_doc(cls))
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}"
        nested = _dataclass_in(hints[f.name])
        if nested is not None:
            suffix, sub_cls = nested
            sub = section(sub_cls, key + suffix)
            sub.doc = "\n\n".join(p for p in (docs.get(f.name, ""), sub.doc) if p)
            sub.type, sub.default = _type_text(cls, f.name), _yaml(_default(f))
            out.sections.append(sub)
            continue
        out.keys.append(Key(key, _type_text(cls, f.name), _yaml(_default(f)), docs.get(f.name, "")))
        free = FREE_FORM_SECTIONS.get(key)
        if free is not None:
            import importlib

            sub = section(getattr(importlib.import_module(free[0]), free[1]), key)
            sub.doc = "\n\n".join(p for p in (docs.get(f.name, ""), sub.doc) if p)
            out.sections.append(sub)
    return out


def config_sections() -> list[Section]:
    """One ``Section`` per field of ``PipelineConfig``, in its order."""
    from streamrl.pipeline_config import PipelineConfig

    docs = field_docs(PipelineConfig)
    hints = _hints(PipelineConfig)
    out = []
    for f in dataclasses.fields(PipelineConfig):
        nested = _dataclass_in(hints[f.name])
        if nested is None or nested[0]:  # a top-level key that is no section of its own
            top = Section(f.name, PipelineConfig, docs.get(f.name, ""), [Key(f.name, _type_text(PipelineConfig, f.name),
                                                           _yaml(_default(f)), docs.get(f.name, ""))])
        else:
            top = section(nested[1], f.name)
            top.doc = "\n\n".join(p for p in (docs.get(f.name, ""), top.doc) if p)
        out.append(top)
    return out


def undocumented_keys() -> list[str]:
    """Every key of the configuration without a comment, and every section with neither a
    comment on the field that holds it nor a class docstring."""
    out = []
    for top in config_sections():
        for s in top.walk():
            if not s.doc:
                out.append(s.path)
            out += [k.path for k in s.keys if not k.doc]
    return out


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_SPECIAL = {"\\": "\\\\", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]", "<": "&lt;", ">": "&gt;"}


def _md_text(text: str) -> str:
    """Comment or docstring text (plain text with RST-style ``code``) as Markdown: its code
    spans kept, and everything else shown as written (``__init__`` is no bold, ``<prefix>`` no
    HTML tag)."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    out, last = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append("".join(_SPECIAL.get(c, c) for c in text[last:m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append("".join(_SPECIAL.get(c, c) for c in text[last:]))
    return "".join(out)


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, outside code spans and in them (Python-Markdown
    splits rows on unescaped pipes; ``\\|`` in a code span renders as a pipe)."""
    return _md_text(text).replace("|", "\\|").replace("\n", " ")


def _code_cell(text: str) -> str:
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text.replace('|', chr(92) + '|')}{pad}{ticks}"


def config_page(top: Section) -> str:
    lines = [f"# `{top.path}`", "",
             f"<!-- generated from the code by docs/reference_pages.py ({top.cls.__module__}."
             f"{top.cls.__qualname__}): edit the comments there, not this page -->", ""]
    for sub in top.walk():
        if sub is not top:
            lines += [f"## `{sub.path}`", ""]
        if sub.doc:
            lines += [_md_text(sub.doc), ""]
        held = f"`{sub.path}`: {_code_cell(sub.type)}" if sub.type else ""
        if held and sub.default != "(section)":
            held += f", default {_code_cell(sub.default)}"
        defined = f"`{sub.cls.__module__}.{sub.cls.__qualname__}`"
        lines += [f"{held}; defined by {defined}." if held else f"Defined by {defined}.", ""]
        if sub.keys:
            lines += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
            lines += [f"| `{k.path}` | {_code_cell(k.type)} | {_code_cell(k.default)} | {_cell(k.doc)} |"
                      for k in sub.keys]
            lines.append("")
    return "\n".join(lines)


def config_index(sections: list[Section]) -> str:
    lines = ["# Configuration reference", "",
             "Every key of the pipeline's configuration, generated from the config dataclasses "
             "each time the site is built (`docs/reference_pages.py`): a key added, renamed or "
             "removed in the code is added, renamed or removed here. How a config is written and "
             "overridden is in [Configuration](../../concepts/configuration.md).", "",
             "| section | keys | what it configures |", "| --- | --- | --- |"]
    for top in sections:
        count = sum(len(s.keys) for s in top.walk())
        first = re.split(r"(?<=\.)\s", top.doc.split("\n\n")[0], maxsplit=1)[0]  # its first sentence
        lines.append(f"| [`{top.path}`]({top.path}.md) | {count} | {_cell(first)} |")
    return "\n".join(lines) + "\n"


def config_pages() -> dict[str, str]:
    """``{site path: Markdown}`` of the configuration reference."""
    sections = config_sections()
    pages = {f"{CONFIG_DIR}/index.md": config_index(sections)}
    for top in sections:
        pages[f"{CONFIG_DIR}/{top.path}.md"] = config_page(top)
    return pages


# -- CLI ----------------------------------------------------------------------------------------

def _subparsers(parser) -> list[tuple[str, Any]]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def cli_page() -> str:
    """Every verb's ``--help`` (and its sub-verbs'), as ``streamrl VERB --help`` prints it in a
    terminal of 100 columns, with no ``STREAMRL_*`` default taken from this environment."""
    saved = {name: os.environ.pop(name, None) for name in ("COLUMNS", "STREAMRL_BOOTSTRAP_SERVERS",
                                                           "STREAMRL_LOG_LEVEL")}
    os.environ["COLUMNS"] = "100"
    try:
        from streamrl.cli import build_parser

        root = build_parser()
        lines = ["# CLI reference", "",
                 "<!-- generated from the code by docs/reference_pages.py (streamrl.cli.build_parser) -->", "",
                 "Every verb of the `streamrl` command, with the `--help` it prints (generated from "
                 "its parser when the site is built). Every verb that reads a config takes "
                 "`key.path=value` overrides ([configuration reference](config/index.md)).", "",
                 "## `streamrl`", "", "```text", root.format_help().rstrip(), "```", ""]

        def add(prefix: str, parser, depth: int) -> None:
            for name, sub in _subparsers(parser):
                title = f"{prefix} {name}"
                lines.extend([f"{'#' * depth} `{title}`", "", "```text", sub.format_help().rstrip(), "```", ""])
                add(title, sub, min(depth + 1, 4))

        add("streamrl", root, 2)
        return "\n".join(lines)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


# -- metrics ------------------------------------------------------------------------------------

def metrics_page() -> str:
    """Every metric of ``streamrl.metrics``, under the section comment it is declared in."""
    from prometheus_client.metrics import MetricWrapperBase

    import streamrl.metrics as metrics

    path = inspect.getsourcefile(metrics)
    tree, _, source_lines = _parsed(path)
    headings = {i + 1: re.sub(r"^#\s*--\s*|\s*-+$", "", line.strip())
                for i, line in enumerate(source_lines) if _HEADING.match(line.strip())}
    lines = ["# Metrics reference", "",
             "<!-- generated from the code by docs/reference_pages.py (streamrl.metrics) -->", "",
             _md_text(inspect.getdoc(metrics) or ""), ""]
    current = None
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        metric = getattr(metrics, stmt.targets[0].id, None)
        if not isinstance(metric, MetricWrapperBase):
            continue
        heading = max((n for n in headings if n < stmt.lineno), default=None)
        if heading != current:
            current = heading
            lines += ["", f"## {_md_text(headings[heading]) if heading else 'Other'}", "",
                      "| metric | type | labels | what it measures |", "| --- | --- | --- | --- |"]
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "_info" if kind == "info" else "")
        labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "-"
        lines.append(f"| `{name}` | {kind} | {labels} | {_cell(metric._documentation)} |")
    return "\n".join(lines) + "\n"


#: parts of hand-written pages made from the code: ``<!-- generated: NAME -->`` in the page
#: (``docs/hooks.py`` puts them in when the site is built)
def snippets() -> dict[str, str]:
    """``{NAME: Markdown}``: the verl guide's table of keys, from ``streamrl.verl.VERL_TABLE``
    (the table the parser and ``streamrl run --dry-run`` read), and its count of verl's schema."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from streamrl.verl import coverage_table, markdown_table

    return {"verl-keys": markdown_table(), "verl-coverage": coverage_table()}


def pages() -> dict[str, str]:
    """Every generated page, ``{site path: Markdown}``."""
    if str(ROOT) not in sys.path:  # this checkout's streamrl, whatever else is installed
        sys.path.insert(0, str(ROOT))
    return {**config_pages(), CLI_PAGE: cli_page(), METRICS_PAGE: metrics_page()}


if __name__ == "__main__":
    if sys.argv[1:] == ["--json"]:  # what docs/hooks.py reads, from a fresh interpreter each build
        print(json.dumps({**pages(), SNIPPETS: snippets()}))
        sys.exit(0)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for rel, text in pages().items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    missing = undocumented_keys()
    print(f"{len(pages())} pages in {out}; {len(missing)} keys without a comment", file=sys.stderr)
    for key in missing:
        print("  " + key, file=sys.stderr)
