"""streamrl's error tree, a leaf module (it imports nothing of streamrl).

Every error a user can act on derives from ``StreamrlError``; the CLI prints its message on one
line, with no traceback, and exits 2. The message names what to change: the config field, the
command-line override, the address, the missing extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class StreamrlError(Exception):
    """An error the user can act on; its message is one line that says what to change."""


class ConfigError(StreamrlError, ValueError):
    """A bad config: the message names the field, and where the value came from."""


class MissingExtra(StreamrlError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def need(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency, or fail in one line naming the extra that installs it:
    ``streamrl run needs torch: pip install 'streamrl[cpu]'``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {module.split('.')[0]}: pip install 'streamrl[{extra}]'") from None
