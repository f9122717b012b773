"""verl's validation figures, computed as verl computes them (``process_validation_metrics`` in
``verl/trainer/ppo/metric_utils.py``), so a streamrl run and a verl run of the same policy on
the same set read the same numbers.

Per data source, per prompt, per variable (``reward``, plus every numeric field a scorer returns
in its dict, such as ``acc``): ``mean@N`` and, when ``N > 1``, ``std@N`` and for ``k`` in 2, 4,
8, ... and ``N``: ``best@k`` / ``worst@k`` (the max / min of ``k`` responses drawn with
replacement, 1000 bootstrap draws seeded with ``seed``; their mean and std), and ``maj@k`` when
the scorer gives a ``pred`` (the value of the majority answer). Each figure is then averaged over
the prompts. verl reports the core variable's (``acc`` where the scorer gives it, else
``reward``) ``mean``/``best``/``maj`` at the largest ``k`` under ``val-core/`` and the rest under
``val-aux/`` (``tracker_names``). tests/evaluation/test_eval.py checks this module against verl's own
function on random inputs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

N_BOOTSTRAP = 1000


def _ks(n: int) -> list[int]:
    """2, 4, 8, ... below ``n``, then ``n`` (none for one response)."""
    if n <= 1:
        return []
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def _bootstrap(n: int, k: int, seed: int) -> np.ndarray:
    """``[N_BOOTSTRAP, k]`` draws with replacement from ``range(n)``: the same as verl's
    ``np.random.seed(seed); np.random.choice(...)``, from a generator of its own."""
    return np.random.RandomState(seed).choice(n, size=(N_BOOTSTRAP, k), replace=True)


def _majority(preds: Sequence[Any], vals: np.ndarray) -> float:
    """The value of the first response that gave the most common answer (ties: the answer seen
    first), as verl's ``calc_maj_val``."""
    counts: dict[Any, int] = {}
    first: dict[Any, float] = {}
    for p, v in zip(preds, vals):
        counts[p] = counts.get(p, 0) + 1
        first.setdefault(p, float(v))
    return first[max(counts, key=counts.get)]  # type: ignore[arg-type]


def prompt_figures(values: Sequence[Any], preds: Sequence[Any] | None, seed: int) -> dict[str, float]:
    """One prompt's figures for one variable's ``values`` (one per response)."""
    vals = np.asarray([float(v) for v in values], dtype=np.float64)
    n = len(vals)
    out = {f"mean@{n}": float(np.mean(vals))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(vals))
    for k in _ks(n):
        idx = _bootstrap(n, k, seed)
        best, worst = vals[idx].max(axis=1), vals[idx].min(axis=1)
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = float(np.mean(best)), float(np.std(best))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = float(np.mean(worst)), float(np.std(worst))
        if preds is not None:
            maj = np.array([_majority([preds[i] for i in row], vals[row]) for row in idx])
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return out


def validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence[str], infos: dict[str, Sequence[Any]],
                       seed: int = 42) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {variable: {figure: value}}}`` over responses given as parallel lists:
    each one's data source, its prompt (responses of one prompt share the id) and its variables
    (``infos["reward"]``, ``infos["acc"]``, ``infos["pred"]``, ...). A variable whose values are
    strings is not a figure (``pred`` is the vote); ``None`` values are left out."""
    grouped: dict[str, dict[str, dict[str, list[Any]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, ds in enumerate(data_sources):
        per_var = grouped[ds][prompt_ids[i]]
        for name, values in infos.items():
            per_var[name].append(values[i])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for ds, prompts in grouped.items():
        per_figure: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for per_var in prompts.values():
            raw_preds = per_var.get("pred")
            for name, raw in per_var.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                preds = raw_preds if (raw_preds is not None and len(raw_preds) == len(values)
                                      and all(p is not None for p in raw_preds)) else None
                for figure, value in prompt_figures(values, preds, seed).items():
                    per_figure[name][figure].append(value)
        out[ds] = {name: {fig: float(np.mean(vals)) for fig, vals in figs.items()} for name, figs in per_figure.items()}
    return out


def response_figures(rows: Sequence[tuple[str, str, float, dict[str, Any]]], seed: int = 42) -> dict[str, dict[str, float]]:
    """``{data_source: {"<variable>/<figure>": value}}`` of scored responses, each given as
    ``(data_source, prompt id, reward, reward_info)``: the variables are the reward and every
    field of the scorer's dict that is a number, a bool or the vote (``pred``), as verl's
    ``reward_extra_infos_dict`` holds them."""
    names = sorted({k for *_, info in rows for k, v in info.items() if isinstance(v, (bool, int, float, str))}
                   - {"reward"} | {"reward"})
    infos = {n: [reward if n == "reward" else _scalar(info.get(n)) for _, _, reward, info in rows] for n in names}
    figures = validation_metrics([r[0] for r in rows], [r[1] for r in rows], infos, seed)
    return {ds: {f"{var}/{fig}": v for var, figs in per_var.items() for fig, v in figs.items()}
            for ds, per_var in figures.items()}


def _scalar(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else None


def core_variable(metrics: dict[str, float]) -> str:
    """The variable verl reports under ``val-core/``: ``acc`` where the scorer gives it."""
    return "acc" if any(k.startswith("acc/") for k in metrics) else "reward"


def tracker_names(data_source: str, metrics: dict[str, float], core: str) -> dict[str, float]:
    """An eval record's ``<variable>/<figure>`` metrics under verl's tracker names:
    ``val-core/<data_source>/<core>/{mean,best,maj}@<largest k>...``, everything else
    ``val-aux/<data_source>/...``."""
    largest: dict[str, int] = {}
    for key in metrics:
        var, _, figure = key.partition("/")
        k = int(figure.split("@")[-1].split("/")[0])
        largest[var] = max(largest.get(var, 0), k)
    out = {}
    for key, value in metrics.items():
        var, _, figure = key.partition("/")
        core_figure = (var == core and figure.startswith(("mean", "maj", "best"))
                       and f"@{largest[var]}" in figure)
        out[f"{'val-core' if core_figure else 'val-aux'}/{data_source}/{key}"] = value
    return out
