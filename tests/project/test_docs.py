"""The docs site: it builds strictly (a broken link or anchor, a missing page, a page left out of
the nav fail), its reference pages are generated from the code and every configuration key has
a comment to generate them from, the getting-started page's commands run as written, and README
stays the front door."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers import ROOT, alive, descendants, last_json_line

DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("reference_pages", DOCS / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = _generator()


# -- the generated reference -------------------------------------------------------------------

def test_every_config_key_has_a_comment():
    """The configuration reference is generated from the comments on the config dataclasses'
    fields: a key without one would be a row that says nothing."""
    missing = gen.undocumented_keys()
    assert not missing, ("config keys without a `#` comment on their line or the line(s) above "
                         f"(the docs' configuration reference is generated from them): {missing}")


@dataclass
class _Inner:
    """An inner section."""

    depth: int = 2  # how deep


@dataclass
class _Entry:
    """One entry."""

    weight: float = 1.0  # its weight


@dataclass
class _Outer:
    # -- a heading, not documentation -----------------------------------------------------
    # the first line above
    # and the second
    name: str = "x"  # and the one on its line
    bare: int = 0
    inner: _Inner = field(default_factory=_Inner)
    table: dict[str, _Entry] = field(default_factory=lambda: {"a": _Entry()})
    items: list[_Entry] = field(default_factory=list)  # a list of entries
    maybe: Optional[_Inner] = None  # an optional section
    union: _Inner | None = None  # the same, written as a union


def test_the_generator_reads_comments_and_walks_sections():
    """A key's documentation is the comment lines directly above it and the one on its line (a
    `# --` heading is not); dataclass fields, mappings and lists of them become sub-sections."""
    top = gen.section(_Outer, "outer")
    keys = {k.path: k for s in top.walk() for k in s.keys}
    assert keys["outer.name"].doc == "the first line above and the second and the one on its line"
    assert keys["outer.name"].default == '"x"' and keys["outer.name"].type == "str"
    assert keys["outer.bare"].doc == ""
    assert keys["outer.inner.depth"].doc == "how deep" and keys["outer.inner.depth"].default == "2"
    assert keys["outer.table.<name>.weight"].default == "1.0"
    assert keys["outer.items[].weight"].doc == "its weight"
    sections = {s.path: s for s in top.walk()}
    assert sections["outer.table.<name>"].default == "{a: ...}"
    assert sections["outer.items[]"].doc.startswith("a list of entries")
    assert keys["outer.maybe.depth"].doc == keys["outer.union.depth"].doc == "how deep"
    assert sections["outer.maybe"].default == "null" and sections["outer.union"].type == "_Inner | None"

    page = gen.config_page(top)
    assert "## `outer.inner`" in page and "| `outer.inner.depth` | `int` | `2` | how deep |" in page


def test_the_reference_follows_the_code():
    """Every section of PipelineConfig has its page, every field of every section is a row of
    it, and the CLI page has every verb's --help; the metrics page every metric."""
    from streamrl.cli import VERBS
    from streamrl.pipeline_config import PipelineConfig

    pages = gen.pages()
    for f in dataclasses.fields(PipelineConfig):
        page = pages[f"reference/config/{f.name}.md"]
        assert page.startswith(f"# `{f.name}`")
        for sub in dataclasses.fields(type(getattr(PipelineConfig(), f.name))):
            assert f"`{f.name}.{sub.name}" in page, (f.name, sub.name)
    cli = pages["reference/cli.md"]
    for verb in VERBS:
        assert f"## `streamrl {verb}`" in cli and f"usage: streamrl {verb}" in cli
    assert "### `streamrl bench bus`" in cli and "usage: streamrl topics" in cli and "{create,describe}" in cli
    import streamrl.metrics as metrics
    from prometheus_client.metrics import MetricWrapperBase

    declared = {m._name for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    assert declared and all(f"`{name}" in pages["reference/metrics.md"] for name in declared)


# -- the site ----------------------------------------------------------------------------------

def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a nav
    entry without its page fails, with the reference pages generated from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "getting-started/index.html", "reference/config/learner/index.html",
                 "reference/cli/index.html", "reference/metrics/index.html", "benchmarks/results/index.html"):
        assert (site / page).exists(), page
    learner = (site / "reference/config/learner/index.html").read_text()
    assert "learner.max_staleness" in learner and "learner.parallel.nproc" in learner
    assert (site / "bench_pipeline.png").exists() and (site / "run_reward.png").exists()


# -- README ------------------------------------------------------------------------------------

def test_readme_is_the_front_door():
    """At most 200 lines, the two set-up commands first (.ci/run and the README's promise), and
    every docs page it links to exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert [line.split()[:2] for line in first_block] == [["make", "run"], ["make", "test"]]
    assert text.index("make run") < text.index("\n## ")
    links = re.findall(r"\]\(((?:docs/)[^)#\s]+)", text)
    assert links and not [link for link in links if not (ROOT / link).exists()]
    # the tour's first commands are getting-started's, which the test below runs
    page = (DOCS / "getting-started.md").read_text().split("## A first session", 1)[1]
    assert re.search(r"```bash\n(.*?)```", page, re.S).group(0) in text


# -- BENCHMARKS.md: today's figures first, the history beside them ------------------------------

def _slug(heading: str) -> str:
    """A heading's anchor as both GitHub and the site write it (for headings without ``--``)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_benchmarks_has_todays_figure_of_every_bench_and_links_its_history():
    """BENCHMARKS.md answers "how fast is it now, and how was that measured" first: one section
    per bench of ``streamrl bench --help``, in its order, each with the command, a tree (a
    commit) and a date, and a link to the bench's section of the history, which holds every
    earlier figure; the page stays a few screens long and says where a new figure goes."""
    from streamrl.commands.bench import BENCHES

    text = (ROOT / "BENCHMARKS.md").read_text()
    history = (DOCS / "benchmarks" / "history.md").read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert "**Adding a figure.**" in text.split("\n## ", 1)[0]
    sections = dict(re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    benches = [m.group(1) for h in sections if (m := re.fullmatch(r"`streamrl bench (\w+)`", h))]
    assert benches == list(BENCHES), benches
    anchors = {_slug(h) for h in re.findall(r"^## (.+)$", history, re.M)}
    for heading, body in sections.items():
        name = heading.strip("`").removeprefix("streamrl bench ")
        if name in BENCHES:
            assert f"`streamrl bench {name}" in body, heading
        assert re.search(r"`[0-9a-f]{7,40}`", body) and re.search(r"\b20\d\d-\d\d-\d\d\b", body), heading
        links = re.findall(r"\]\(docs/benchmarks/history\.md#([\w-]+)\)", body)
        assert links and set(links) <= anchors and _slug(heading) in links, (heading, links)
    assert all(f"## `streamrl bench {name}`" in history for name in BENCHES)


# -- the getting-started page's commands, run as written ----------------------------------------

def first_session() -> list[tuple[list[str], str]]:
    """The commands of getting-started's "A first session" block, as argv and their comment."""
    page = (DOCS / "getting-started.md").read_text()
    part = page.split("## A first session", 1)[1]
    block = re.search(r"```bash\n(.*?)```", part, re.S).group(1)
    out = []
    for line in block.splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            out.append((shlex.split(command), comment.strip()))
    return out


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_getting_started_commands_run_as_written(tmp_path):
    """In an empty directory: the help, a short run stopped with Ctrl-C where the page says (every
    process of it ends), the resume that finishes it, and the replay of its archive."""
    commands = first_session()
    assert [argv[:2] for argv, _ in commands] == [["streamrl", "run"]] * 3 + [["streamrl", "replay"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    results = []
    for argv, comment in commands:
        argv = [sys.executable, "-m", "streamrl", *argv[1:]]
        stop_at = re.search(r"Ctrl-C once the status line shows version (\d+)", comment)
        if stop_at is None:
            done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
            results.append((done.returncode, done.stdout, done.stderr))
            continue
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 400
            target = re.compile(rf"^version ({'|'.join(str(v) for v in range(int(stop_at.group(1)), 100))})/")
            while not any(target.match(line) for line in list(lines)):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.2)
            stages = descendants(proc.pid)  # the broker and every stage
            proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C, to `streamrl run` alone
            out = proc.communicate(timeout=180)[0]
            time.sleep(0.5)
            assert len(stages) >= 5 and not [pid for pid in stages if alive(pid)], "a process outlived Ctrl-C"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        reader.join(10)
        results.append((proc.returncode, out, "".join(lines)))

    (rc, out, _), (rc_run, out_run, err_run), (rc_resume, out_resume, err_resume), (rc_replay, out_replay, err_replay) = results
    assert rc == 0 and "usage: streamrl run" in out and "--resume" in out
    assert rc_run == 130, err_run[-3000:]
    stopped = last_json_line(out_run)
    assert stopped["ended"] == "interrupted" and "streamrl run --resume" in stopped["resume"]
    assert rc_resume == 0, err_resume[-3000:]
    match = re.search(r"run: resuming (\S+) from version (\d+)", err_resume)
    assert match and Path(match.group(1)) == Path(stopped["out"]) and int(match.group(2)) >= 2, err_resume[-3000:]
    finished = last_json_line(out_resume)
    assert finished["ended"] == "done" and finished["versions"] == 8 and finished["earlier_sessions"]
    assert "0" in finished["reward_by_version"]  # the summary covers both sessions
    assert rc_replay == 0, err_replay[-3000:]
    assert "archive" in err_replay and Path(stopped["out"]).name in err_replay
    report = json.loads(out_replay.strip().splitlines()[-1])
    assert report["by_data_source"]["digits"]["n"] > 0
