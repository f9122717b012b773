"""The prompt feed: GSM8K rows to prompts (verl's template and ground truth), stable group ids,
new ids per epoch, parquet like JSONL, verl's format recognised by its columns, bad rows refused
before anything is published; GSM8K by name through ``datasets`` from a directory in the hub's
layout, and the one-line error when it can be neither fetched nor found in the cache."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.config import ConfigError
from streamrl.records import Prompt
from streamrl.feed.config import FeedConfig
from streamrl.feed.prompts import FeedError, build_prompts, gsm8k_ground_truth
from streamrl.feed.stage import publish_feed
from tests.helpers import gsm8k_path, last_json_line, read_topic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gsm8k() -> str:
    """GSM8K's test split, the real rows (from shared/ beside the clone), as a file."""
    return str(gsm8k_path("test"))


def first_rows(n: int) -> list[dict]:
    with open(gsm8k_path("test"), encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_gsm8k_prompt_and_ground_truth_follow_verl(gsm8k):
    cfg = FeedConfig(dataset=gsm8k, limit=3, shuffle=False, group_size=5)
    prompts = list(build_prompts(cfg))
    rows = first_rows(3)
    assert len(prompts) == 3
    p = prompts[0]
    assert p.prompt == [{"role": "user", "content": rows[0]["question"] + " Let's think step by step "
                         "and output the final answer after \"####\"."}]
    assert p.ground_truth == "18"  # "... #### 18" (Janet's ducks)
    assert p.group_size == 5 and p.data_source == "gsm8k" and p.epoch == 0
    assert p.extra_info["index"] == 0 and p.extra_info["answer"] == rows[0]["answer"]
    for p, row in zip(prompts, rows):
        assert p.ground_truth == row["answer"].split("#### ")[1].replace(",", "")
    assert gsm8k_ground_truth("so 1,234 in all\n#### 1,234") == "1234"
    assert gsm8k_ground_truth("#### -3.5") == "-3.5"


def test_group_ids_are_stable_and_new_per_epoch(gsm8k):
    cfg = FeedConfig(dataset=gsm8k, limit=20, epochs=2, shuffle=True, seed=7)
    a, b = list(build_prompts(cfg)), list(build_prompts(cfg))
    assert [p.group_id for p in a] == [p.group_id for p in b]  # same feed, same ids
    assert len({p.group_id for p in a}) == 40  # 20 rows x 2 epochs, all distinct
    by_epoch = {e: {p.extra_info["index"]: p.group_id for p in a if p.epoch == e} for e in (0, 1)}
    assert set(by_epoch[0]) == set(by_epoch[1]) == set(range(20))
    assert not set(by_epoch[0].values()) & set(by_epoch[1].values())
    # the order is shuffled per epoch, the ids do not depend on it
    order0 = [p.extra_info["index"] for p in a if p.epoch == 0]
    assert order0 != sorted(order0)
    unshuffled = {p.extra_info["index"]: p.group_id for p in build_prompts(
        FeedConfig(dataset=gsm8k, limit=20, shuffle=False))}
    assert unshuffled == by_epoch[0]
    # continuing a feed at epoch 1 gives epoch 1's ids
    cont = {p.extra_info["index"]: p.group_id for p in build_prompts(
        FeedConfig(dataset=gsm8k, limit=20, start_epoch=1))}
    assert cont == by_epoch[1]


def test_parquet_reads_like_jsonl(gsm8k, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(first_rows(4)), path)
    from_parquet = list(build_prompts(FeedConfig(dataset=str(path), shuffle=False)))
    from_jsonl = list(build_prompts(FeedConfig(dataset=gsm8k, limit=4, shuffle=False)))
    assert [(p.group_id, p.prompt, p.ground_truth) for p in from_parquet] == \
           [(p.group_id, p.prompt, p.ground_truth) for p in from_jsonl]


def test_bad_rows_and_config_are_refused(gsm8k, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(FeedError, match="row 1.*####"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    bad.write_text(json.dumps({"answer": "#### 1"}) + "\n")
    with pytest.raises(FeedError, match="no field 'question'"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    bad.write_text("{not json\n")
    with pytest.raises(FeedError, match="bad.jsonl:1"):
        list(build_prompts(FeedConfig(dataset=str(bad))))
    with pytest.raises(ConfigError, match="feed.dataset"):
        list(build_prompts(FeedConfig(dataset=str(tmp_path / "missing.jsonl"))))
    with pytest.raises(ConfigError, match="feed.ground_truth"):
        list(build_prompts(FeedConfig(dataset=gsm8k, ground_truth="magic")))


def verl_prepared(rows: list[dict], split: str) -> list[dict]:
    """GSM8K rows as verl's ``examples/data_preprocess/gsm8k.py`` writes them (its columns,
    written here from its documented format)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": row["question"] + " Let's think step by step and output "
                         "the final answer after \"####\"."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(row["answer"])},
             "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]}}
            for i, row in enumerate(rows)]


def test_verls_format_is_recognised_with_no_keys(gsm8k, tmp_path):
    """A parquet in verl's format is read as verl reads it with no key set, whatever the template
    keys say (a config made for GSM8K's raw rows, or another task's), and gives the prompts and
    ground truths the raw rows give through the default keys."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_prepared(first_rows(4), "test")), path)
    raw = list(build_prompts(FeedConfig(dataset=gsm8k, limit=4, shuffle=False)))
    for cfg in (FeedConfig(dataset=str(path), shuffle=False),
                FeedConfig(dataset=str(path), shuffle=False, data_source="other", prompt_template="{problem}",
                           ground_truth="field", answer_field="solution")):
        prompts = list(build_prompts(cfg))
        assert [(p.prompt, p.ground_truth) for p in prompts] == [(p.prompt, p.ground_truth) for p in raw]
        assert {p.data_source for p in prompts} == {"openai/gsm8k"}  # the row's own, as verl routes it
        assert prompts[1].extra_info["split"] == "test" and prompts[1].extra_info["index"] == 1
    # feed.format=template reads the same file through the keys instead
    with pytest.raises(FeedError, match="no field 'question'"):
        list(build_prompts(FeedConfig(dataset=str(path), format="template")))


def test_a_row_in_neither_format_names_its_columns_and_the_keys(gsm8k, tmp_path):
    other = tmp_path / "math.jsonl"
    other.write_text(json.dumps({"problem": "1+1?", "solution": "2", "level": 1}) + "\n")
    with pytest.raises(FeedError) as err:
        list(build_prompts(FeedConfig(dataset=str(other))))
    msg = str(err.value)
    assert "\n" not in msg and "row 1" in msg and "no field 'question'" in msg
    assert "columns: problem, solution, level" in msg and "verl's format" in msg
    for key in ("feed.prompt_template='{question} ", "feed.ground_truth='gsm8k'", "feed.answer_field='answer'"):
        assert key in msg, key
    # mapped by those keys, the same file reads
    (p,) = build_prompts(FeedConfig(dataset=str(other), prompt_template="{problem}", ground_truth="field",
                                    answer_field="solution", data_source="math"))
    assert p.prompt == [{"role": "user", "content": "1+1?"}] and p.ground_truth == "2" and p.data_source == "math"
    # feed.format=verl refuses a row that is not verl's, naming what it has
    with pytest.raises(FeedError, match=r"not in verl's format.*the row has: question, answer"):
        list(build_prompts(FeedConfig(dataset=gsm8k, limit=1, format="verl")))
    with pytest.raises(ConfigError, match="feed.format"):
        list(build_prompts(FeedConfig(dataset=gsm8k, format="csv")))


HUB_PROBE = """
import json
from streamrl.datasets import read_rows
from streamrl.errors import StreamrlError
from streamrl.feed.config import FeedConfig
from streamrl.feed.prompts import build_prompts
try:
    out = {"test": read_rows("gsm8k:test"), "train": read_rows("gsm8k", limit=2),
           "truths": [p.ground_truth for p in build_prompts(FeedConfig(dataset="gsm8k:test", shuffle=False))]}
except StreamrlError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""


def write_hub_layout(repo: Path, splits: dict[str, list[dict]]) -> None:
    """``openai/gsm8k`` as the hub lays it out: a dataset card whose YAML names config ``main``
    and its splits' files, and one parquet shard per split under ``main/``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (repo / "main").mkdir(parents=True)
    card = ["---", "configs:", "- config_name: main", "  data_files:"]
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), repo / "main" / f"{split}-00000-of-00001.parquet")
        card += [f"  - split: {split}", f"    path: main/{split}-*"]
    (repo / "README.md").write_text("\n".join([*card, "---", ""]))


def hub_probe(cwd: Path, hf_home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", HUB_PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json_line(proc.stdout)


def test_gsm8k_by_name_goes_through_datasets_with_no_network(tmp_path):
    """``gsm8k`` / ``gsm8k:test`` are ``datasets.load_dataset("openai/gsm8k", "main")`` as verl
    loads them. No network here: ``datasets`` resolves a repo id that names a local directory to
    that directory, so the call runs unchanged against ``openai/gsm8k`` written in the hub's
    layout; with no such directory, offline and nothing cached, it is one line naming both ways."""
    with open(gsm8k_path("train"), encoding="utf-8") as f:
        train = [json.loads(next(f)) for _ in range(3)]
    test = first_rows(5)
    work = tmp_path / "work"
    write_hub_layout(work / "openai" / "gsm8k", {"train": train, "test": test})
    out = hub_probe(work, tmp_path / "hf")
    assert out.get("test") == test, out
    assert out["train"] == train[:2]
    assert out["truths"] == [gsm8k_ground_truth(r["answer"]) for r in test]
    assert (tmp_path / "hf" / "datasets").is_dir()  # datasets cached what it read, under HF_HOME

    empty = tmp_path / "empty"
    empty.mkdir()
    out = hub_probe(empty, tmp_path / "nothing")
    assert out.get("error") == "ConfigError", out
    msg = out["message"]
    assert "\n" not in msg and msg.startswith("config field 'feed.dataset': 'gsm8k:test'")
    assert "openai/gsm8k" in msg and "connect once" in msg and "feed.dataset=PATH" in msg and ".parquet" in msg


def test_without_the_hf_extra_a_hub_name_says_both_ways(monkeypatch):
    from streamrl.datasets import read_rows
    from streamrl.errors import MissingExtra

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"needs datasets: pip install 'streamrl\[hf\]' "
                                           r"\(or give a file: feed.dataset=PATH"):
        read_rows("gsm8k")


def test_publish_feed_to_the_broker(gsm8k, bus):
    cfg = FeedConfig(dataset=gsm8k, limit=5, epochs=2, group_size=3)
    assert asyncio.run(publish_feed(bus, cfg)) == 10
    messages = asyncio.run(read_topic(bus, "prompts", 10, timeout_s=20))
    prompts = [Prompt.decode(m.value) for m in messages]
    assert sorted(p.group_id for p in prompts) == sorted(p.group_id for p in build_prompts(cfg))
    assert all(m.key == p.group_id.encode() for m, p in zip(messages, prompts))
    assert {p.epoch for p in prompts} == {0, 1} and all(p.group_size == 3 for p in prompts)


def test_example_config_loads():
    from streamrl.pipeline_config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "rollout.example.yaml")
    cfg.rollout.validate()
    assert cfg.feed.prompt_template == FeedConfig().prompt_template
    assert cfg.feed.group_size == 4 and cfg.rollout.backend == "transformers"


def test_a_verl_rows_structured_ground_truth_reaches_its_scorer(tmp_path):
    """verl's search-R1 rows carry ``{"target": [...]}`` (a parquet struct of a string list), others
    an integer: the record's text ground truth is JSON / the number's text, never a Python repr,
    and search-R1's scorer reads it back."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamrl.scorers import search_r1

    rows = [{"data_source": "searchR1_nq", "prompt": [{"role": "user", "content": "capital of France?"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris", "City of Light"]}}},
            {"data_source": "aime24", "prompt": [{"role": "user", "content": "2+2?"}],
             "reward_model": {"style": "rule", "ground_truth": 4}}]
    for i, row in enumerate(rows):  # one file each: parquet wants one type per column
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / f"{i}.parquet")
    (search,) = build_prompts(FeedConfig(dataset=str(tmp_path / "0.parquet"), shuffle=False))
    (aime,) = build_prompts(FeedConfig(dataset=str(tmp_path / "1.parquet"), shuffle=False))
    assert json.loads(search.ground_truth) == {"target": ["Paris", "City of Light"]} and aime.ground_truth == "4"
    assert search_r1.compute_score("searchR1_nq", "<answer>city of light</answer>", search.ground_truth)["score"] == 1.0
