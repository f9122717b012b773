"""The one way streamrl loads a user's object (scorer function, reward class, group hook,
interaction class): ``package.module:name`` or ``path/to/file.py:name``.

A file is loaded as a module of its own (named after its resolved path, so two files with the
same name do not collide) and registered in ``sys.modules``, so worker processes and pickling
find it again. A bad reference is a ``ConfigError`` naming the config field it came from.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError


@functools.lru_cache(maxsize=None)
def load_object(ref: str, field: str = "reference", kind: str = "object") -> Any:
    """The object ``ref`` names: ``module:name`` or ``file.py:name`` (a path relative to the
    working directory). ``field`` names the config field and ``kind`` what was wanted, in errors."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"config field {field!r}: {ref!r} is not 'package.module:name' or 'file.py:name'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ConfigError(f"config field {field!r}: cannot load {ref!r}: no file {path}")
        mod_name = "streamrl_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"config field {field!r}: cannot load {ref!r}: cannot import {target}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None or (kind in ("function", "class") and not callable(obj)):
        raise ConfigError(f"config field {field!r}: cannot load {ref!r}: {target} has no {kind} {attr!r}")
    return obj
