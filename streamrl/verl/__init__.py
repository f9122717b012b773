"""verl's keys with verl's meaning: ONE table (``VERL_TABLE``) says, for every key a verl launch
script or config may carry, what it becomes here, why it changes nothing here, or what is
missing for it. The table drives three things, so they cannot disagree: the parser
(``read_verl_keys``, called by ``streamrl.pipeline_config``), ``streamrl run --dry-run``'s report,
and the table of ``docs/guides/verl.md`` (``markdown_table``, generated when the site is built).

A row is one of:

- ``mapped``: the key sets streamrl keys (``to``), by default to its value as given; ``read``
  turns the value (and the other verl keys given, for keys verl reads together, such as
  ``train_batch_size`` with ``ppo_mini_batch_size``) into ``{streamrl key: value}``, and may
  raise ``Refused`` for a value that has no counterpart (``adv_estimator=gae``) or ``ValueError``
  for a bad one.
- ``ignored``: accepted and named once at start as not applicable, with the reason: the key
  tunes verl's own machinery (Megatron, the reference's log-prob pass, Ray, profilers) and does
  not change what trains. ``harmless`` values of a ``refused`` row are treated the same way
  (``top_k=-1`` is verl's "off").
- ``refused``: the key would change what trains and streamrl has no counterpart; ``note`` says
  what is missing. Keys refused for the same reason are reported together, in one line.

A row's ``key`` is a verl key, or a pattern (``prefix.*`` every key under ``prefix``,
``*._target_`` every section's class; the row naming most of a key wins). Adding a key is adding
a row; every key of verl's schema has one (``streamrl.verl.schema``, held by a test).

Values, not names, decide a refusal: a key at verl's default (for the engine given,
``model_engine``) or at a ``harmless`` value is accepted whatever its row, and ``null`` where
verl's default is ``null`` sets nothing. Values are read with Hydra's override grammar
(``streamrl.verl.overrides``); Hydra's ``+key`` and ``++key`` are read as ``key``, and a ``+key``
that verl's schema lacks and no row names is accepted as verl accepts it, named at start as read
by nothing here. A report names the key as it was typed.

The package: ``rows`` (a row, the shared reasons, the value readers), ``table`` / ``table_actor``
(the rows by section), ``schema`` / ``schema_data`` (verl's keys and defaults, recorded by
tools/verl_schema.py), ``overrides`` (the grammar), ``entries`` (a launch script's entry module:
a recipe's trainer, ``run.verl_entry``); this module reads keys through them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping

from streamrl.verl.overrides import OverrideError, format_value, parse_override
from streamrl.verl.rows import IGNORED, MAPPED, REFUSED, Given, NotApplicable, Refused, Row, _harmless, engine_given
from streamrl.verl.schema import engine_of, schema_keys, verl_defaults
from streamrl.verl.table import VERL_TABLE, VERL_TOPS

__all__ = ["Row", "Refused", "KeyOutcome", "VERL_TABLE", "VERL_TOPS", "MAPPED", "IGNORED", "REFUSED", "is_verl_key",
           "read_verl_keys", "read_command_line", "problem_lines", "ignored_line", "markdown_table", "find_row",
           "coverage", "coverage_table", "format_value", "show"]

AT_DEFAULT = "verl's default, which changes nothing"
ADDED = ("not in verl's schema: Hydra adds it (+) and verl accepts it; nothing streamrl knows of in verl reads it, "
         "and nothing here does")


def find_row(key: str) -> Row | None:
    """The row for ``key``: an exact one, else the most specific pattern that matches."""
    return _find_row(key)


@lru_cache(maxsize=4096)
def _find_row(key: str) -> Row | None:
    if key.endswith("._target_"):  # the class verl builds a section with: the same row in every section
        return next(r for r in VERL_TABLE if r.key == "*._target_")
    best = None
    for row in VERL_TABLE:
        if row.key == key:
            return row
        if row.matches(key) and (best is None or row.specificity > best.specificity):
            best = row
    return best


def is_verl_key(key: str) -> bool:
    """Whether an override's key (Hydra's ``+``/``++`` allowed) is verl's: under one of verl's
    own sections, or a row of the table (``reward.custom_reward_function.path``, beside
    streamrl's ``reward`` section)."""
    key = key.lstrip("+~")
    return key.split(".", 1)[0] in VERL_TOPS or key in schema_keys() or find_row(key) is not None


@dataclass
class KeyOutcome:
    """What one verl key given became: ``kind`` is mapped, ignored, refused, unknown or bad."""

    typed: str  # the key as typed (with Hydra's prefix)
    key: str
    value: Any
    kind: str
    sets: dict[str, Any] = field(default_factory=dict)  # mapped: streamrl key -> value
    why: str = ""  # ignored: the reason; refused: what is missing; unknown / bad: the problem

    def line(self) -> str:
        """The dry run's report line."""
        given = f"{self.typed}={show(self.value)}"
        if self.kind == MAPPED:
            if not self.sets:  # read with other keys, or a value that needs nothing here
                return f"{given} -> nothing set ({self.why})"
            return f"{given} -> " + " ".join(f"{k}={show(v)}" for k, v in self.sets.items())
        if self.kind == IGNORED:
            return f"{given} -> not applicable here: {self.why}"
        return f"{given} -> {self.kind}: {self.why}"


def show(value: Any) -> str:
    """A value as the report lines write it (``true``, ``[a,b]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


def read_verl_keys(given: Iterable[tuple[str, Any]]) -> list[KeyOutcome]:
    """Each verl key given (``(typed key, value)``, in order: a later one wins) through the
    table, its value compared with verl's default for the engine given. Never raises: a problem
    is an outcome (``refused``, ``unknown``, ``bad``)."""
    given = list(given)
    by_key = {typed.lstrip("+~"): value for typed, value in given}
    defaults = verl_defaults(engine_of(engine_given(by_key)))
    return [_read_one(typed, value, by_key, defaults) for typed, value in given]


def _read_one(typed: str, value: Any, by_key: Given, defaults: Mapping[str, Any]) -> KeyOutcome:
    key = typed.lstrip("+~")
    if typed.startswith("~"):
        return KeyOutcome(typed, key, value, "bad", why="Hydra's ~ (remove a key of verl's config) is not read here: "
                                                        "give the key a value")
    row = find_row(key)
    at_default = key in defaults and _same_value(value, defaults[key])
    if row is None:
        if typed.startswith("+") and key not in schema_keys():
            return KeyOutcome(typed, key, value, IGNORED, why=ADDED)
        close = difflib.get_close_matches(key, _known(), n=1, cutoff=0.8)
        return KeyOutcome(typed, key, value, "unknown", why="not a verl key streamrl knows"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    if row.kind == IGNORED:
        return KeyOutcome(typed, key, value, IGNORED, why=row.note)
    if row.kind == REFUSED:
        if at_default or _harmless(value, row.harmless):
            return KeyOutcome(typed, key, value, IGNORED, why=AT_DEFAULT)
        return KeyOutcome(typed, key, value, REFUSED, why=row.note)
    if value is None and key in defaults and defaults[key] is None:
        return KeyOutcome(typed, key, value, MAPPED, why="null, verl's default: streamrl's own default")
    try:
        return KeyOutcome(typed, key, value, MAPPED, row.apply(key, value, by_key), why=row.note)
    except NotApplicable as exc:
        return KeyOutcome(typed, key, value, IGNORED, why=str(exc))
    except Refused as exc:
        if at_default:
            return KeyOutcome(typed, key, value, IGNORED, why=AT_DEFAULT)
        return KeyOutcome(typed, key, value, REFUSED, why=str(exc))
    except (ValueError, TypeError) as exc:
        return KeyOutcome(typed, key, value, "bad", why=str(exc))


@lru_cache(maxsize=1)
def _known() -> list[str]:
    return sorted({r.key for r in VERL_TABLE} | schema_keys())


def _same_value(value: Any, default: Any) -> bool:
    """``value`` is ``default`` (a bool only equal to a bool, ``1`` to ``1.0``, lists item by item)."""
    if isinstance(value, bool) or isinstance(default, bool) or value is None or default is None:
        return type(value) is type(default) and value == default
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return len(value) == len(default) and all(_same_value(a, b) for a, b in zip(value, default))
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    return type(value) is type(default) and value == default


def read_command_line(override: str) -> tuple[list[tuple[str, Any]], str]:
    """One verl override (``key=value``, Hydra's grammar) as ``(typed key, value)`` pairs, or
    a problem line naming it. A dict given to a key that is no leaf of verl's schema is one key
    per leaf (``+reward.reward_kwargs={a: 1}``), as verl merges it."""
    try:
        parsed = parse_override(override)
    except OverrideError as exc:
        return [], f"{override}: cannot read it ({exc})"
    if isinstance(parsed.value, dict) and parsed.value and parsed.key not in schema_keys():
        return [(parsed.prefix + key, value) for key, value in _flatten(parsed.value, parsed.key)], ""
    return [(parsed.typed, parsed.value)], ""


def _flatten(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    if not isinstance(tree, dict) or not tree:
        return [(prefix, tree)]
    out = []
    for k, v in tree.items():
        out += _flatten(v, f"{prefix}.{k}")
    return out


def coverage() -> dict[str, dict[str, list[str]]]:
    """``{section: {mapped|ignored|refused|none: [keys]}}``: every key of verl's recorded schema
    by its row's kind, per top-level section (the issue's count; the guide prints it)."""
    out: dict[str, dict[str, list[str]]] = {}
    for key in sorted(schema_keys()):
        row = find_row(key)
        kind = row.kind if row is not None else "none"
        out.setdefault(key.split(".", 1)[0], {}).setdefault(kind, []).append(key)
    return out


def problem_lines(outcomes: Iterable[KeyOutcome]) -> list[str]:
    """One line per problem: each unknown key and bad value, and the refused keys grouped by what
    is missing (a PPO script's ``adv_estimator=gae`` and its ``critic.*`` keys: one line)."""
    lines, refusals = [], {}
    for o in outcomes:
        if o.kind in ("unknown", "bad"):
            lines.append(f"{o.typed}={show(o.value)}: {o.why}")
        elif o.kind == REFUSED:
            row = find_row(o.key)  # a key refused whatever its value is named alone (critic.*)
            named = f"{o.typed}={show(o.value)}" if row is not None and row.key == o.key else o.typed
            refusals.setdefault(o.why, []).append(named)
    for why, keys in refusals.items():
        lines.append(f"{', '.join(keys)}: refused, streamrl has no counterpart for {why}")
    return lines


def ignored_line(outcomes: Iterable[KeyOutcome]) -> str:
    """The keys accepted as not applicable, grouped by reason, in one line ("" when none)."""
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        if o.kind == IGNORED:
            groups.setdefault(o.why, []).append(o.typed)
    return "; ".join(f"{', '.join(keys)} ({why})" for why, keys in groups.items())


def coverage_table() -> str:
    """The verl guide's count of verl's schema by section: mapped, not applicable, refused (their
    verl default accepted), and the refused keys by name."""
    from streamrl.verl.schema import VERL_VERSION

    head = (f"verl {VERL_VERSION}'s schema: {len(schema_keys())} keys over its four engines.\n\n"
            "| section | mapped | not applicable | refused (unless at verl's default) |\n| --- | --- | --- | --- |\n")
    rows = []
    for section, kinds in coverage().items():
        refused_keys = ", ".join(f"`{k}`" for k in kinds.get(REFUSED, []))
        rows.append(f"| `{section}` | {len(kinds.get(MAPPED, []))} | {len(kinds.get(IGNORED, []))} | "
                    f"{len(kinds.get(REFUSED, []))}{': ' + refused_keys if refused_keys else ''} |")
    return head + "\n".join(rows) + "\n"


def markdown_table() -> str:
    """The verl guide's table, generated from ``VERL_TABLE`` (docs/hooks.py)."""
    head = "| verl key | here | note |\n| --- | --- | --- |\n"
    rows = []
    for row in VERL_TABLE:
        if row.kind == MAPPED:
            here = ", ".join(f"`{t}`" for t in row.to) or "(read with other keys)"
        elif row.kind == IGNORED:
            here = "accepted, not applicable"
        else:
            here = "refused" + (f" (accepted as {', '.join(show(h) for h in row.harmless)})" if row.harmless else "")
        note = row.note.replace("|", "\\|")
        rows.append(f"| `{row.key}` | {here} | {note} |")
    return head + "\n".join(rows) + "\n"
