"""Which request field turns a vLLM pooling server's activation off, by the version the server
reports: vLLM renamed it (``activation`` up to 0.11.0, ``use_activation`` from 0.11.1) and
ignores a name it does not know, which would silently give sigmoid scores."""

from __future__ import annotations

import re
from typing import Any

# The first vLLM release whose pooling requests read ``use_activation`` (0.11.0's PoolingParams
# has ``activation``; 0.11.1's has ``use_activation`` and marks ``activation`` deprecated: the
# vLLM API reference of each version, vllm/pooling_params.py; vLLM PR #25524).
VLLM_USE_ACTIVATION_SINCE = (0, 11, 1)


def vllm_version_tuple(version: str) -> tuple[int, ...] | None:
    """``"0.11.1rc2.dev5+g1234"`` -> ``(0, 11, 1)``; None when it does not start with a version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if not m:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


def activation_fields_for(version_answer: Any) -> tuple[str, ...]:
    """The request field(s) that turn the activation off, for a server's ``GET /version``
    answer: vLLM's ``{"version": "0.11.0"}`` -> ``("activation",)``, 0.11.1 and later ->
    ``("use_activation",)``; streamrl's own server (``{"engine": "streamrl"}``) reads
    ``use_activation``; anything else -> both (a vLLM ignores the name it does not know)."""
    if isinstance(version_answer, dict):
        if version_answer.get("engine") == "streamrl":
            return ("use_activation",)
        parsed = vllm_version_tuple(str(version_answer.get("version", "")))
        if parsed is not None:
            return ("use_activation",) if parsed >= VLLM_USE_ACTIVATION_SINCE else ("activation",)
    return ("activation", "use_activation")
