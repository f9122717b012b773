"""The replay report: old against new rewards, overall, per ``data_source`` and per policy
version, and the files a replay writes (``report.json``, ``report.md``, ``report.png``, the
per-record results as ``results.jsonl`` or ``results.parquet``).

Statistics are over the records the new scorer scored; records that failed are counted and
listed with their reasons, never scored 0. The *old* reward of a rewarded record is its
scorer's own reward: ``reward_info.group.raw_reward`` when a group hook adjusted it (the
published reward is then an advantage, not a score), else ``reward``. Binary views (agreement,
the confusion table) threshold both at ``THRESHOLD``: a reward of at least 0.5 counts as 1.

The JSON report holds no wall-clock times and no absolute paths, so the same replay gives the
same report byte for byte.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import orjson

from streamrl.plotting import save
from streamrl.records import Rewarded, Trajectory

THRESHOLD = 0.5
HISTOGRAM_BINS = 10
_MARKDOWN_FAILURES = 50


def old_reward(record: Trajectory) -> float | None:
    """The scorer's own reward in a rewarded record (see the module docstring); None for a
    trajectory."""
    if not isinstance(record, Rewarded):
        return None
    group = record.reward_info.get("group") if isinstance(record.reward_info, dict) else None
    raw = group.get("raw_reward") if isinstance(group, dict) else None
    return float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else float(record.reward)


def distribution(values: list[float]) -> dict[str, float | int] | None:
    """Count, mean, population std, min, quartiles (linear interpolation) and max."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    p25, p50, p75 = np.percentile(a, [25, 50, 75])
    return {"n": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "p25": float(p25), "median": float(p50), "p75": float(p75), "max": float(a.max())}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Old against new over the rows with a new reward."""
    scored = [r for r in rows if r["new_reward"] is not None]
    new = [r["new_reward"] for r in scored]
    old = [r["old_reward"] for r in scored if r["old_reward"] is not None]
    pairs = [(r["old_reward"], r["new_reward"]) for r in scored if r["old_reward"] is not None]
    confusion = None
    agreement = pearson = None
    if pairs:
        cells = Counter((o >= THRESHOLD, n >= THRESHOLD) for o, n in pairs)
        confusion = {"old1_new1": cells[True, True], "old1_new0": cells[True, False],
                     "old0_new1": cells[False, True], "old0_new0": cells[False, False]}
        agreement = (confusion["old1_new1"] + confusion["old0_new0"]) / len(pairs)
        o, n = np.asarray(pairs, dtype=np.float64).T
        if len(pairs) > 1 and o.std() > 0 and n.std() > 0:
            pearson = float(np.corrcoef(o, n)[0, 1])
    old_dist, new_dist = distribution(old), distribution(new)
    return {"scored": len(scored), "compared": len(pairs),
            "mean_old": old_dist["mean"] if old_dist else None,
            "mean_new": new_dist["mean"] if new_dist else None,
            "agreement": agreement, "pearson": pearson, "confusion": confusion,
            "old": old_dist, "new": new_dist}


def histogram(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Counts of old and new rewards in ``HISTOGRAM_BINS`` equal bins over their joint range
    (each bin half-open, the last closed)."""
    old = [r["old_reward"] for r in rows if r["new_reward"] is not None and r["old_reward"] is not None]
    new = [r["new_reward"] for r in rows if r["new_reward"] is not None]
    both = old + new
    if not both:
        return None
    lo, hi = min(both), max(both)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, HISTOGRAM_BINS + 1)
    count = lambda v: np.histogram(v, bins=edges)[0].tolist() if v else None  # noqa: E731
    return {"edges": edges.tolist(), "old": count(old), "new": count(new)}


def _by(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """``summarize`` per value of ``key``, in the values' order (versions numerically)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return {str(k): {"records": len(v), **summarize(v)} for k, v in sorted(groups.items())}


def build_report(*, mode: str, source: dict[str, Any], scorer: dict[str, Any], rows: list[dict[str, Any]],
                 failures: list[dict[str, Any]], messages: int | None = None, skipped: int = 0,
                 duplicates: int = 0) -> dict[str, Any]:
    """The report's dict. ``rows``: one per unique record (``result_row``); ``failures``: decode
    failures and scoring failures together."""
    return {
        "mode": mode, "source": source, "scorer": scorer, "threshold": THRESHOLD,
        "messages": messages, "skipped": skipped, "duplicates": duplicates,
        "records": len(rows), "failed": len(failures),
        "failed_by_reason": dict(sorted(Counter(f["reason"] for f in failures).items())),
        **summarize(rows),
        "histogram": histogram(rows),
        "by_data_source": _by(rows, lambda r: r["data_source"]),
        "by_version": _by(rows, lambda r: r["policy_version"]),  # in version order
        "failures": failures,
    }


def result_row(record: Trajectory, *, partition: int | None, offset: int | None, new_reward: float | None,
               reward_info: dict[str, Any], scorer: str | None) -> dict[str, Any]:
    """One line of the results file."""
    return {"id": record.id, "partition": partition, "offset": offset, "group_id": record.group_id,
            "data_source": record.data_source, "policy_version": record.policy_version,
            "old_reward": old_reward(record), "new_reward": new_reward, "scorer": scorer,
            "reward_info": reward_info, "response": record.response, "ground_truth": record.ground_truth}


# -- files ------------------------------------------------------------------------------------------

def write_all(report: dict[str, Any], rows: list[dict[str, Any]], out: Path, fmt: str = "jsonl") -> Path:
    """Results, plot, Markdown and JSON report into ``out``; returns the JSON report's path."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / f"results.{fmt}"
    write_results(rows, results, fmt)
    plot(report, out / "report.png")
    report = {**report, "files": {"results": results.name, "markdown": "report.md", "plot": "report.png"}}
    (out / "report.md").write_text(markdown(report))
    path = out / "report.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return path


def write_results(rows: list[dict[str, Any]], path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        with path.open("wb") as f:
            for row in rows:
                f.write(orjson.dumps(row) + b"\n")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{**r, "reward_info": orjson.dumps(r["reward_info"]).decode()} for r in rows]
        pq.write_table(pa.Table.from_pylist(flat), path)
    else:
        raise ValueError(f"results format {fmt!r}: jsonl or parquet")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _table(header: Iterable[str], lines: Iterable[Iterable[Any]]) -> str:
    header = list(header)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(v) for v in line) + " |" for line in lines]
    return "\n".join(out)


def _group_lines(groups: dict[str, Any]) -> list[list[Any]]:
    return [[k, g["records"], g["scored"], g["mean_old"], g["mean_new"], g["agreement"], g["pearson"]]
            for k, g in groups.items()]


def markdown(report: dict[str, Any]) -> str:
    src = report["source"]
    where = (f"topic `{src['topic']}`, from {', '.join(src['from']) or 'the start'} "
             f"to {', '.join(src['to']) or 'the end'}"
             if report["mode"] == "topic" else f"policy `{src['policy']}` on `{src['prompts']}`")
    scorers = ", ".join(f"{k} (version {v})" for k, v in report["scorer"]["entries"].items())
    parts = [
        "# Replay report", "",
        f"{where}; scorer `{report['scorer']['spec']}`: {scorers}.", "",
        _table(["messages", "skipped", "duplicates", "records", "scored", "failed"],
               [[report["messages"], report["skipped"], report["duplicates"], report["records"],
                 report["scored"], report["failed"]]]), "",
        "## Old against new", "",
        _table(["", "mean", "std", "min", "median", "max"],
               [[name, *(None,) * 5] if d is None else [name, d["mean"], d["std"], d["min"], d["median"], d["max"]]
                for name, d in (("old", report["old"]), ("new", report["new"]))]), "",
        f"Agreement (both at least {report['threshold']} or both below): {_fmt(report['agreement'])} over "
        f"{report['compared']} records; Pearson correlation {_fmt(report['pearson'])}.", "",
    ]
    c = report["confusion"]
    if c:
        parts += [_table(["", "new 1", "new 0"], [["old 1", c["old1_new1"], c["old1_new0"]],
                                                   ["old 0", c["old0_new1"], c["old0_new0"]]]), ""]
    head = ["records", "scored", "mean old", "mean new", "agreement", "pearson"]
    parts += ["## By data source", "", _table(["data_source", *head], _group_lines(report["by_data_source"])), "",
              "## By policy version", "", _table(["version", *head], _group_lines(report["by_version"])), ""]
    if report.get("files"):
        parts += [f"![rewards]({report['files']['plot']})", ""]
    failures = report["failures"]
    if failures:
        parts += ["## Failed", "", _table(["reason", "count"], report["failed_by_reason"].items()), "",
                  _table(["stage", "reason", "partition", "offset", "id", "detail"],
                         [[f["stage"], f["reason"], f["partition"], f["offset"], f["id"],
                           f["detail"][:200].replace("|", "\\|").replace("\n", " ")]
                          for f in failures[:_MARKDOWN_FAILURES]]), ""]
        if len(failures) > _MARKDOWN_FAILURES:
            parts += [f"... and {len(failures) - _MARKDOWN_FAILURES} more (report.json lists all).", ""]
    return "\n".join(parts)


def plot(report: dict[str, Any], path: Path) -> None:
    """Old and new reward distributions, and mean reward by policy version (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    hist = report["histogram"]
    if hist:
        edges = np.asarray(hist["edges"])
        width = (edges[1] - edges[0]) * 0.4
        centers = (edges[:-1] + edges[1:]) / 2
        if hist["old"] is not None:
            left.bar(centers - width / 2, hist["old"], width=width, label="old", color="#8c8c8c")
        left.bar(centers + (width / 2 if hist["old"] is not None else 0), hist["new"], width=width,
                 label="new", color="#1f77b4")
        left.legend()
    left.set(title="reward distribution", xlabel="reward", ylabel="records")
    versions = list(report["by_version"])
    x = [int(v) for v in versions]
    for side, color in (("old", "#8c8c8c"), ("new", "#1f77b4")):
        y = [report["by_version"][v][f"mean_{side}"] for v in versions]
        if any(v is not None for v in y):
            right.plot(x, [np.nan if v is None else v for v in y], marker="o", label=side, color=color)
    if x:
        right.legend()
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set(title="mean reward by policy version", xlabel="policy version", ylabel="mean reward")
    save(fig, path, dpi=100)
