"""The one way streamrl draws a PNG (run summary, replay report, benchmarks): matplotlib's
pyplot on the Agg backend, so no display is needed, and every figure laid out, written and
closed in one call, so none leaks in a long-running process."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (imported here: matplotlib is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 80) -> Path:
    """Lay ``fig`` out, write it to ``path`` (making its directory), close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
