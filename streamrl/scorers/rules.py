"""The built-in rule scorers and verl's ``default_compute_score`` over them.

As in verl's ``reward_score`` package, each rule is a small module with verl's scorer signature
(``gsm8k``, ``math_verify``, ``math_dapo``, ``geo3k``, ``search_r1``, ``prime_math``, ``code``); this
registry says which data sources each serves and where it runs by default. The reward stage's table
(``streamrl.reward.table``) starts from these entries; a new family is a module and a row here.

verl's code families (``codecontests``, ``apps``, ``codeforces``, ``taco``) run the response against
the row's test cases, isolated (``streamrl.scorers.code`` over ``streamrl.sandbox``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from streamrl.errors import Failure
from streamrl.loading import load_object


@dataclass(frozen=True)
class Rule:
    """A built-in rule scorer: its function, where it runs by default, what it serves."""

    ref: str
    executor: str  # thread: off the event loop, with a timeout; process: CPU-heavy (SymPy)
    data_sources: tuple[str, ...]


#: verl's search-R1 data sources (exact match), as its default_compute_score lists them
SEARCH_R1_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
#: verl's NuminaMath data sources (PRIME's math grader)
NUMINA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                  "numina_cn_k12", "numina_olympiads")
#: The MATH data sources verl scores with its own MATH rule (math_reward)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")

RULES: dict[str, Rule] = {
    "gsm8k": Rule("streamrl.scorers.gsm8k:compute_score", "thread", ("gsm8k", "openai/gsm8k")),
    "digits": Rule("streamrl.scorers.digits:compute_score", "thread", ("digits",)),  # streamrl.tasks.digits
    "math": Rule("streamrl.scorers.math_verify:compute_score", "process", ("math", *MATH_SOURCES)),
    # a trailing "*" serves every data source with that prefix (verl: data_source.startswith("aime"))
    "math_dapo": Rule("streamrl.scorers.math_dapo:compute_score", "process",
                      ("math_dapo", "math_dapo_reasoning", "aime*")),
    "geo3k": Rule("streamrl.scorers.geo3k:compute_score", "process", ("hiyouga/geometry3k",)),  # SymPy
    "search_r1": Rule("streamrl.scorers.search_r1:compute_score", "thread", SEARCH_R1_SOURCES),
    "prime_math": Rule("streamrl.scorers.prime_math:compute_score", "process", NUMINA_SOURCES),  # SymPy
    # verl's code families: the response run against the row's test cases, isolated (streamrl.sandbox);
    # async: its executions are subprocesses or HTTP calls, awaited on the loop
    "code": Rule("streamrl.scorers.code:compute_score", "inline", ("codecontests", "apps", "codeforces", "taco")),
}


def default_compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                          extra_info: dict[str, Any] | None = None, **kwargs: Any) -> float | dict:
    """verl's ``default_compute_score``: one call, dispatched to the built-in rule that serves
    ``data_source``, run right here (no worker process, no timeout). An async rule (code) is run
    to its end, as verl's function returns only when scored."""
    for rule in RULES.values():
        if any(serves(pattern, data_source) for pattern in rule.data_sources):
            result = load_object(rule.ref)(data_source, solution_str, ground_truth, extra_info, **kwargs)
            return _finished(result) if inspect.iscoroutine(result) else result
    raise Failure("unknown_data_source", f"no built-in scorer for data_source {data_source!r}")


def _finished(coro: Any) -> Any:
    """An async rule's result from sync code: on this thread, or on a thread of its own when this
    one already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def serves(pattern: str, data_source: str) -> bool:
    """A route: an exact data source, or a prefix ending in ``*``."""
    return data_source.startswith(pattern[:-1]) if pattern.endswith("*") else data_source == pattern


def verl_compat(scorers: dict[str, Any], spec_type: type) -> dict[str, Any]:
    """The scorer table with every data source scored as verl 0.9.1's ``default_compute_score``
    scores it (``reward.verl_compat: true``), where streamrl's defaults differ:

    - ``openai/gsm8k``: verl's gsm8k in its strict mode (``#### N`` only, format score 0), where
      streamrl's default reads every common answer form (entry ``verl_gsm8k``);
    - ``lighteval/MATH`` and the other MATH data sources: verl's MATH rule (``math_reward``:
      normalised strings), where streamrl's default is math-verify (entry ``verl_math``);
    - ``math``: DAPO's scorer, where streamrl's default is the MATH rule; and DAPO's scorer
      (``math_dapo``, ``aime*``, ``math``) with verl's string comparison (``method: verl``),
      where streamrl's default adds math-verify's equivalences.

    ``geo3k``, ``search_r1`` and ``prime_math`` score as verl in both modes. Entries the config set itself keep
    their routes except for those data sources, and a ``method`` the config gave is kept."""
    out = dict(scorers)
    if "gsm8k" in out and "openai/gsm8k" in (out["gsm8k"].data_sources or []):
        out["gsm8k"] = _without(out["gsm8k"], "openai/gsm8k")
        out["verl_gsm8k"] = spec_type(type="rule", rule="gsm8k", data_sources=["openai/gsm8k"],
                                      kwargs={"method": "strict", "format_score": 0.0, "score": 1.0})
    if "math" in out and out["math"].type == "rule":
        moved = [ds for ds in MATH_SOURCES if ds in (out["math"].data_sources or [])]
        if moved:
            for ds in moved:
                out["math"] = _without(out["math"], ds)
            out["verl_math"] = spec_type(type="rule", rule="math", data_sources=moved, kwargs={"method": "verl"})
    if "math" in out and "math" in (out["math"].data_sources or []) and "math_dapo" in out:
        out["math"] = _without(out["math"], "math")
        out["math_dapo"] = dataclasses.replace(out["math_dapo"], data_sources=[*(out["math_dapo"].data_sources or []), "math"])
    if "math_dapo" in out and out["math_dapo"].type == "rule" and "method" not in out["math_dapo"].kwargs:
        out["math_dapo"] = dataclasses.replace(out["math_dapo"], kwargs={**out["math_dapo"].kwargs, "method": "verl"})
    return out


#: The entries ``verl_compat`` adds: default routes, which an entry of the user's may take
VERL_COMPAT_ENTRIES = {"gsm8k": "verl_gsm8k", "math": "verl_math"}


def _without(spec: Any, data_source: str) -> Any:
    return dataclasses.replace(spec, data_sources=[d for d in spec.data_sources if d != data_source])
