"""The one harness of ``streamrl bench``: a bench declares what it varies and what one run of a
variant measures; the harness does the rest the same way for every bench.

A bench is a subclass of ``Bench`` that sets ``name``, ``variants`` (what it varies: schedules,
group sizes, client modes, ...) and ``rounds`` (repeats, or seeds), and writes ``measure(variant,
round)`` (one run: its figures, any object), ``summary(runs)`` (the JSON object, from the runs by
variant: ``Runs.medians`` and friends), and optionally ``report`` (the text table above the JSON),
``plot`` and ``session`` (what every run shares: a broker, simulated servers, a loaded model).
``run(bench)`` then:

- enters the session, runs every variant in every round, rounds outer and variants inner, so that
  load from other work on a shared machine falls on every variant alike;
- shows progress on stderr (one tqdm bar; a run with several steps ticks them itself with
  ``self.progress``, and writes status lines with ``self.note``);
- hands the runs to ``summary``, draws ``plot`` to ``OUT/NAME.png``, prints ``report``, adds the
  bench's wall time (``seconds_key``) and the plot's path, writes ``OUT/NAME.json`` and prints the
  summary as the last line of stdout: what ``streamrl bench`` promises and what BENCHMARKS.md
  quotes.

``measure`` may be a coroutine function: then the whole bench runs in one event loop, and
``session`` may return an async context manager.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence

from streamrl.runtime import broker_for


class Runs(dict):
    """variant -> its runs' results, in round order."""

    def single(self) -> dict[Any, Any]:
        """variant -> its one run (a bench of one round)."""
        return {v: rs[0] for v, rs in self.items()}

    def values_of(self, variant: Any, key: Any = None) -> list[Any]:
        """The rounds' results of ``variant`` (``key``: each result's ``[key]``)."""
        return [r if key is None else r[key] for r in self[variant]]

    def median(self, variant: Any, key: Any = None) -> float:
        return statistics.median(self.values_of(variant, key))

    def best(self, variant: Any, key: Any = None) -> float:
        """The highest over rounds (as ``timeit`` takes the fastest run: load from other work
        only ever slows a run down)."""
        return max(self.values_of(variant, key))

    def medians(self, variant: Any) -> dict[str, float]:
        """Every key of ``variant``'s results (dicts of numbers), its median over rounds."""
        first = self[variant][0]
        return {k: self.median(variant, k) for k in first}


class Bench:
    """What a bench declares. Subclasses set the class attributes (or set them in ``__init__``
    from the command's arguments) and override ``measure`` and ``summary``."""

    #: ``streamrl bench NAME``: the progress bar's label, ``OUT/NAME.json`` and ``OUT/NAME.png``
    name: ClassVar[str] = "bench"
    #: what the bench varies, in run order within a round
    variants: Sequence[Any] = ("run",)
    #: how many times every variant runs (repeats, or seeds: ``measure`` gets the round's index)
    rounds: int = 1
    #: where the JSON and the plot go; None: the summary goes to stdout only
    out: Path | None = None
    #: progress steps in one run (``measure`` ticks them with ``self.progress.update``)
    units: int = 1
    #: the summary key of the bench's own wall time (None: not reported)
    seconds_key: str | None = "seconds"
    #: runs on a broker: ``--bootstrap-servers``, or the embedded one; its bus config is ``self.bus``
    broker: bool = False

    progress: Any = None  # the tqdm bar, while the runs go
    runs: Runs  # the runs so far, while they go (a variant may depend on an earlier one's result)
    bus: Any = None  # the broker's ``BusConfig`` (``broker = True``), while the runs go

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out) if getattr(args, "out", None) else None

    def session(self) -> Any:
        """What every run shares, as a context manager (async for an async ``measure``)."""
        return contextlib.nullcontext()

    def measure(self, variant: Any, round: int) -> Any:
        """One run of ``variant``: its figures (any object ``summary`` reads)."""
        raise NotImplementedError

    def summary(self, runs: Runs) -> dict[str, Any]:
        """The JSON object (the harness adds the wall time and the plot's path)."""
        raise NotImplementedError

    def report(self, runs: Runs, summary: dict[str, Any]) -> None:
        """The text above the JSON line (a table: ``table``)."""

    plot: Callable[[Runs, dict[str, Any], Path], Any] | None = None
    """``plot(runs, summary, path)`` draws the figure to ``path`` (``streamrl.plotting``)."""

    def note(self, text: str) -> None:
        """A status line on stderr that leaves the progress bar whole."""
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)


def run(bench: Bench) -> int:
    """Run ``bench`` (variants x rounds), then summarise, plot, report, write and print its JSON."""
    started = time.monotonic()
    runs = collect(bench)
    summary = bench.summary(runs)
    plot_path = None
    if bench.plot is not None and bench.out is not None:
        plot_path = bench.out / f"{bench.name}.png"
        bench.plot(runs, summary, plot_path)
    bench.report(runs, summary)
    if bench.seconds_key:
        summary[bench.seconds_key] = round(time.monotonic() - started, 1)
    if plot_path is not None:
        summary["plot"] = str(plot_path)
    if bench.out is not None:
        bench.out.mkdir(parents=True, exist_ok=True)
        (bench.out / f"{bench.name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


def collect(bench: Bench) -> Runs:
    """Every variant in every round (rounds outer) in the bench's session, with a progress bar;
    the runs by variant."""
    from tqdm import tqdm

    bench.runs = Runs({v: [] for v in bench.variants})
    with contextlib.ExitStack() as stack:
        if bench.broker:
            bench.bus = stack.enter_context(broker(bench.args.bootstrap_servers))
        bench.progress = stack.enter_context(tqdm(total=len(bench.variants) * bench.rounds * bench.units,
                                                  file=sys.stderr, dynamic_ncols=True))
        if inspect.iscoroutinefunction(bench.measure):
            async def all_runs() -> None:
                async with _async(bench.session()):
                    for r, v, done in _steps(bench):
                        done(await bench.measure(v, r))

            asyncio.run(all_runs())
        else:
            with bench.session():
                for r, v, done in _steps(bench):
                    done(bench.measure(v, r))
    bench.progress = None
    return bench.runs


def _steps(bench: Bench) -> Iterator[tuple[int, Any, Callable[[Any], None]]]:
    """``(round, variant, done)`` for every run in order; ``done(result)`` keeps the result and
    moves the bar past the run's steps that it did not tick itself."""
    bar = bench.progress
    for r in range(bench.rounds):
        for v in bench.variants:
            bar.set_description(f"bench {bench.name} {v}" + (f" {r + 1}/{bench.rounds}" if bench.rounds > 1 else ""))
            target = bar.n + bench.units

            def done(result: Any, v: Any = v, target: int = target) -> None:
                bench.runs[v].append(result)
                bar.update(max(0, target - bar.n))

            yield r, v, done


@contextlib.asynccontextmanager
async def _async(cm: Any) -> Any:
    """A context manager entered from async code, whichever kind it is."""
    if hasattr(cm, "__aenter__"):
        async with cm as value:
            yield value
    else:
        with cm as value:
            yield value


# -- what several benches' declarations share ------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned, each as wide as
    its widest cell (cells are printed as given: format numbers before)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def add_common_arguments(parser: argparse.ArgumentParser, *, quick: str, out: str | None = None,
                         bootstrap: bool = True) -> None:
    """The flags benches share: ``--bootstrap-servers`` (the broker; default: the embedded one),
    ``--quick`` (help: ``quick``) and ``--out`` (help: ``out``; None: the bench writes no files)."""
    if bootstrap:
        from streamrl.commands.common import add_bootstrap_argument

        add_bootstrap_argument(parser)
    parser.add_argument("--quick", action="store_true", help=quick)
    if out is not None:
        parser.add_argument("--out", default="runs/bench", help=out)


@contextlib.contextmanager
def broker(bootstrap_servers: str = "") -> Iterator[Any]:
    """The bus config of the broker a bench runs on: ``bootstrap_servers`` (checked to answer), or
    the embedded broker for the block's duration (its address set in the config)."""
    from streamrl.pipeline_config import PipelineConfig

    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = bootstrap_servers
    with broker_for(cfg):
        yield cfg.bus
