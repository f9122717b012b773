"""verl's command line as Hydra reads it: ``key=value``, ``+key=value``, ``++key=value``, with
values in Hydra's override grammar (quoted strings, lists, dicts, escapes, ``*`` and other
unquoted characters), so that every value a verl user types is read as verl reads it, or
refused with a line naming the key as typed, never a traceback.

Why a grammar of our own rather than hydra-core's parser: hydra-core (1.3.x, its current
release) pins ``omegaconf<2.4`` and ``antlr4-python3-runtime==4.9.*``, and installing it would
move the project's OmegaConf (2.4) and ANTLR runtime back a release; the part of its grammar a
value needs is small (below, and tests/verl/test_verl_overrides.py holds it to Hydra's cases).

What it reads, as Hydra 1.3 does:

- ``null`` / ``true`` / ``false`` (any case), integers (``1_000``, ``+3``), floats (``1e-6``,
  ``.5``, ``inf``, ``nan``), anything else a string; a value of several tokens
  (``~/data/train.parquet``, ``a b``) is a string;
- ``'...'`` and ``"..."``: a string as written (``\\'`` / ``\\"`` inside for the quote);
- ``[a, b, [c]]``, ``{k: v, ...}``, nested; whitespace around their items is not the items';
- ``\\,`` ``\\ `` ``\\\\`` ``\\(`` ``\\)`` ``\\[`` ``\\]`` ``\\{`` ``\\}`` ``\\:`` ``\\=`` in an
  unquoted string: the character itself.

What it refuses, with the reason: a comma outside a list (Hydra's sweep, several runs:
``--multirun`` only), Hydra's functions (``choice(...)``, ``range(...)``), a quote inside an
unquoted value, an unclosed bracket or quote. Unquoted values are read with fewer limits
than Hydra's (``~`` and other characters Hydra wants quoted are accepted as they are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Override", "OverrideError", "parse_override", "parse_value", "format_value"]


class OverrideError(ValueError):
    """A command-line override that cannot be read; the message says why."""


@dataclass(frozen=True)
class Override:
    typed: str  # the key as typed, with Hydra's prefix
    key: str  # without it
    prefix: str  # "", "+", "++" or "~"
    value: Any


_KEY = re.compile(r"[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*")
_INT = re.compile(r"[+-]?(0|[1-9](_?\d)*)")
_FLOAT = re.compile(r"[+-]?((((0|[1-9](_?\d)*)\.)|((0|[1-9](_?\d)*)?\.\d(_?\d)*))|"
                    r"(((0|[1-9](_?\d)*)|((0|[1-9](_?\d)*)\.|(0|[1-9](_?\d)*)?\.\d(_?\d)*))[eE][+-]?\d(_?\d)*)|"
                    r"[Ii][Nn][Ff]|[Nn][Aa][Nn])")
_ESCAPABLE = "\\,() []{}:=\t"
_STOP = ",[]{}()="  # ends an unquoted value (``:`` too inside a dict's key)


def parse_override(text: str) -> Override:
    """``key=value`` (with Hydra's ``+``, ``++`` or ``~``) to an ``Override``; ``OverrideError``
    names what is wrong."""
    head, eq, rest = text.partition("=")
    typed = head.strip()
    prefix = "~" if typed.startswith("~") else "++" if typed.startswith("++") else "+" if typed.startswith("+") else ""
    key = typed[len(prefix):]
    if not _KEY.fullmatch(key):
        raise OverrideError(f"{typed!r} is not a key (dotted names)")
    if not eq and prefix != "~":
        raise OverrideError("no '=': an override is key=value")
    return Override(typed, key, prefix, parse_value(rest) if eq else None)


def parse_value(text: str) -> Any:
    """One override's value, as Hydra reads it (see the module's doc)."""
    parser = _Parser(text)
    if not text.strip():
        return ""  # key= : the empty string, as in Hydra
    value = parser.element()
    parser.skip_ws()
    if parser.peek() == ",":
        raise OverrideError("a comma outside a list: Hydra reads a,b as a sweep (several runs, --multirun); "
                            "write a list [a,b] or quote the value")
    if not parser.done():
        raise OverrideError(f"unexpected {parser.peek()!r} at character {parser.pos + 1} of {text!r}")
    return value


def format_value(value: Any) -> str:
    """A value written so that ``parse_value`` (and Hydra) read it back the same."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text and _reads_as_itself(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _reads_as_itself(text: str) -> bool:
    try:
        return parse_value(text) == text and isinstance(parse_value(text), str)
    except OverrideError:
        return False


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def done(self) -> bool:
        return self.pos >= len(self.text)

    def skip_ws(self) -> None:
        while self.peek() in (" ", "\t") and not self.done():
            self.pos += 1

    def expect(self, char: str) -> None:
        self.skip_ws()
        if self.peek() != char:
            found = repr(self.peek()) if self.peek() else "the end"
            raise OverrideError(f"expected {char!r}, found {found} at character {self.pos + 1} of {self.text!r}")
        self.pos += 1

    def element(self, in_dict_key: bool = False) -> Any:
        self.skip_ws()
        char = self.peek()
        if char == "[":
            return self.sequence("[", "]", self.element)
        if char == "{":
            return dict(self.sequence("{", "}", self.pair))
        if char in ("'", '"'):
            return self.quoted(char)
        return self.primitive(in_dict_key)

    def sequence(self, open_: str, close: str, item: Any) -> list[Any]:
        self.expect(open_)
        out: list[Any] = []
        self.skip_ws()
        if self.peek() == close:
            self.pos += 1
            return out
        while True:
            out.append(item())
            self.skip_ws()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect(close)
            return out

    def pair(self) -> tuple[Any, Any]:
        key = self.element(in_dict_key=True)
        if isinstance(key, (list, dict)) or key is None or key == "":
            raise OverrideError(f"a dict's key must be a name (got {key!r}) in {self.text!r}")
        self.expect(":")
        return str(key) if not isinstance(key, (int, float, bool)) else key, self.element()

    def quoted(self, quote: str) -> str:
        self.pos += 1
        out = []
        while not self.done():
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in (quote, "\\"):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if char == quote:
                self.pos += 1
                return "".join(out)
            out.append(char)
            self.pos += 1
        raise OverrideError(f"an unclosed {quote} in {self.text!r}")

    def primitive(self, in_dict_key: bool) -> Any:
        start, out, escaped = self.pos, [], False
        while not self.done():
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in _ESCAPABLE:
                out.append(self.text[self.pos + 1])
                self.pos += 2
                escaped = True
                continue
            if char == "$" and self.text.startswith("${", self.pos):  # an interpolation, whole
                end = self.text.find("}", self.pos)
                if end < 0:
                    raise OverrideError(f"an unclosed ${{ in {self.text!r}")
                out.append(self.text[self.pos:end + 1])
                self.pos = end + 1
                continue
            if char in _STOP or (in_dict_key and char == ":"):
                break
            if char in ("'", '"'):
                raise OverrideError(f"a quote inside an unquoted value, at character {self.pos + 1} of {self.text!r}: "
                                    "quote the whole value")
            out.append(char)
            self.pos += 1
        if self.peek() == "(":
            name = "".join(out).strip()
            raise OverrideError(f"Hydra's function {name}(...): give the value itself (functions are for sweeps)")
        if self.peek() == "=":
            raise OverrideError(f"an '=' inside a value, at character {self.pos + 1} of {self.text!r}: quote the value")
        word = "".join(out).strip(" \t")
        if not word and not escaped:
            found = repr(self.peek()) if self.peek() else "the end"
            raise OverrideError(f"a value expected, found {found} at character {start + 1} of {self.text!r}")
        return word if escaped else _typed(word)


def _typed(word: str) -> Any:
    """One unquoted token typed as Hydra types it; several tokens (or anything else) a string."""
    lower = word.lower()
    if lower == "null":
        return None
    if lower in ("true", "false"):
        return lower == "true"
    if _INT.fullmatch(word):
        return int(word.replace("_", ""))
    if _FLOAT.fullmatch(word):
        return float(word.replace("_", ""))
    return word
