"""The prompt feed: a dataset to the prompts topic, one ``Prompt`` per row and epoch.

Rollout workers share the prompts topic as one consumer group, so each record is worked on by
one worker (redelivered only after a crash or a rebalance, which the learner's de-duplication
by trajectory id absorbs). A prompt's ``group_id`` is a hash of (data source, epoch, row index,
prompt): the same dataset fed twice gives the same ids, so a re-run is recognisable downstream
rather than a silent double, and each epoch is a new group.

A row is in one of two formats. verl's, as its ``examples/data_preprocess/*.py`` write it
(``prompt`` already chat messages, ``data_source``, ``reward_model.ground_truth``,
``extra_info``), is recognised by those columns and read as verl reads it, with no key to set.
Any other row goes through ``feed.prompt_template`` / ``ground_truth`` / ``answer_field``; their
defaults follow verl's ``examples/data_preprocess/gsm8k.py`` on GSM8K's own rows: the prompt is
one user message, ``question + " Let's think step by step and output the final answer after
\\"####\\"."``, and the ground truth is the number after ``####`` in ``answer``, commas removed.
A row that fits neither fails naming the columns it has and the keys that map them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import time
from typing import Any, Iterator

import orjson

from streamrl.chat import ChatRenderer
from streamrl.datasets import DatasetError, describe, read_rows
from streamrl.feed.config import FeedConfig
from streamrl.policy import load_tokenizer
from streamrl.records import Prompt

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


#: a dataset row that cannot become a prompt; the message names the file and row
FeedError = DatasetError


def gsm8k_ground_truth(answer: str) -> str:
    """verl's ``extract_solution``: the number after the first ``#### ``, commas removed."""
    match = _GSM8K_ANSWER.search(answer)
    if match is None:
        raise ValueError("no '#### <number>' in the answer")
    return match.group(1).replace(",", "")


def group_id(data_source: str, epoch: int, index: int, prompt: Any) -> str:
    """Stable across runs and machines: the same row of the same epoch always gets the same id."""
    h = hashlib.sha256(orjson.dumps([data_source, epoch, index, prompt]))
    return h.hexdigest()[:32]


def is_verl_row(row: dict[str, Any], prompt_key: str = "prompt") -> bool:
    """A row as verl's preprocessing writes it: a chat-list ``prompt`` (``feed.prompt_key``) and
    a ``reward_model`` holding ``ground_truth`` (beside ``data_source`` and ``extra_info``)."""
    prompt, reward_model = row.get(prompt_key), row.get("reward_model")
    return (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)
            and isinstance(reward_model, dict) and "ground_truth" in reward_model)


def _unmapped(row: dict[str, Any], cfg: FeedConfig, what: str) -> str:
    """Why a row fits no format: its columns, verl's, and the keys that map other rows."""
    columns = ", ".join(map(str, row)) or "none"
    if cfg.format == "verl":
        return (f"{what}; feed.format=verl needs verl's columns (a chat-list prompt, data_source, "
                f"reward_model.ground_truth), the row has: {columns}")
    return (f"{what}; the row has columns: {columns}. It is not verl's format (a chat-list prompt, data_source, "
            f"reward_model.ground_truth), so these keys map it: feed.prompt_template={cfg.prompt_template!r} "
            f"(its {{fields}} are columns), feed.ground_truth={cfg.ground_truth!r} with "
            f"feed.answer_field={cfg.answer_field!r}, feed.data_source={cfg.data_source!r}")


def _template_fields(row: dict[str, Any], cfg: FeedConfig) -> tuple[Any, str | None]:
    """The prompt and ground truth of a row that is not verl's, through the feed's keys."""
    if cfg.prompt_template:
        text = cfg.prompt_template.format(**row)
        prompt: Any = [{"role": "user", "content": text}] if cfg.chat else text
    else:
        prompt = row["prompt"]
    if cfg.ground_truth == "gsm8k":
        return prompt, gsm8k_ground_truth(str(row[cfg.answer_field]))
    if cfg.ground_truth == "field":
        return prompt, str(row[cfg.answer_field])
    if cfg.ground_truth == "verl":
        return prompt, _verl_truth(row)
    return prompt, None


def _verl_truth(row: dict[str, Any]) -> str | None:
    """A verl row's ``reward_model.ground_truth`` as the record's text: a string as it is, a number
    as its text, a structure as JSON (search-R1's ``{"target": [...]}``, a parquet list column:
    the scorers read it back, ``streamrl.scorers.search_r1``), never a Python repr."""
    truth = row["reward_model"]["ground_truth"]
    if truth is None or isinstance(truth, str):
        return truth
    if isinstance(truth, (dict, list, tuple)) or hasattr(truth, "tolist"):
        return orjson.dumps(truth, option=orjson.OPT_SERIALIZE_NUMPY, default=_jsonable).decode()
    return str(truth)


def _jsonable(value: Any) -> Any:
    """What orjson cannot write itself: numpy scalars of other kinds, arrays of objects (parquet's
    string lists), anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _carries(value: Any) -> bool:
    """Whether a row's multimodal column holds something (parquet gives an absent one as None
    or an empty list)."""
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:
        return True


def row_to_prompt(row: dict[str, Any], index: int, epoch: int, cfg: FeedConfig,
                  where: str = "row") -> Prompt:
    """One dataset row as a prompt. The row's ``extra_info`` is copied whole into the prompt's,
    so verl's per-sample fields (``interaction_kwargs``, ``tools_kwargs``) reach the rollout
    worker's interactions and tools as the dataset wrote them."""
    for kind, key, column in (("images", "image_key", cfg.image_key), ("videos", "video_key", cfg.video_key),
                              ("audio", "audio_key", cfg.audio_key)):
        if column and _carries(row.get(column)):
            raise FeedError(f"{where}: column {column!r} carries {kind} (verl's data.{key}, feed.{key}): "
                            "streamrl's rollout workers read text prompts only")
    verl = cfg.format == "verl" or (cfg.format == "auto" and is_verl_row(row, cfg.prompt_key))
    if verl and not is_verl_row(row, cfg.prompt_key):
        raise FeedError(f"{where}: " + _unmapped(row, cfg, "not in verl's format"))
    try:
        prompt, truth = (row[cfg.prompt_key], _verl_truth(row)) if verl else _template_fields(row, cfg)
    except KeyError as exc:
        raise FeedError(f"{where}: " + _unmapped(row, cfg, f"no field {exc}")) from None
    except (ValueError, IndexError, TypeError) as exc:
        raise FeedError(f"{where}: {exc}") from None
    # a verl row names its own data source (verl routes its reward by it); feed.data_source
    # only fills in where it has none
    data_source = (str(row.get("data_source") or "") or cfg.data_source) if verl else \
        (cfg.data_source or str(row.get("data_source") or ""))
    if not data_source:
        raise FeedError(f"{where}: no data_source (set feed.data_source)")
    extra = {"index": index}
    for name in ("question", cfg.answer_field):
        if isinstance(row.get(name), str):
            extra[name] = row[name]
    if isinstance(row.get("extra_info"), dict):
        extra.update(row["extra_info"])
    if isinstance(row.get("agent_name"), str) and row["agent_name"]:  # verl's column: the sample's agent loop
        extra["agent_name"] = row["agent_name"]
    return Prompt(group_id=group_id(data_source, epoch, index, prompt), group_size=cfg.group_size,
                  data_source=data_source, prompt=prompt, ground_truth=truth, extra_info=extra,
                  epoch=epoch)


def read_feed_rows(cfg: FeedConfig) -> list[tuple[dict[str, Any], str]]:
    """The rows of ``feed.dataset`` then of each of ``feed.more_datasets`` (verl reads a list of
    files as one), ``feed.limit`` in all, each with where it is (for messages)."""
    out: list[tuple[dict[str, Any], str]] = []
    for spec in [cfg.dataset, *cfg.more_datasets]:
        left = cfg.limit - len(out) if cfg.limit else 0
        if cfg.limit and left <= 0:
            break
        out += [(row, f"{describe(spec)} row {i + 1}") for i, row in enumerate(read_rows(spec, left))]
    return out


def build_prompts(cfg: FeedConfig) -> Iterator[Prompt]:
    """Every prompt of the feed, epoch by epoch. All rows are converted (and, with
    ``max_prompt_length``, measured) before the first is yielded, so a bad row stops the feed
    before anything is published."""
    cfg.validate()
    base = [row_to_prompt(row, i, cfg.start_epoch, cfg, where) for i, (row, where) in enumerate(read_feed_rows(cfg))]
    if cfg.max_prompt_length:
        base = fit_prompt_length(base, cfg)
    for epoch in range(cfg.start_epoch, cfg.start_epoch + cfg.epochs):
        order = list(range(len(base)))
        if cfg.shuffle:
            random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
        for i in order:
            p = base[i]
            yield dataclasses.replace(p, epoch=epoch, created_at=time.time(),
                                      group_id=group_id(p.data_source, epoch, i, p.prompt))


def fit_prompt_length(prompts: list[Prompt], cfg: FeedConfig) -> list[Prompt]:
    """verl's ``max_prompt_length`` as its dataset applies it: a prompt's tokens are counted
    through the chat template of the policy's tokenizer (``feed.tokenizer``); a longer one is
    dropped (``filter_overlong_prompts``), or cut (``truncation`` left / right / middle: the
    prompt becomes that text, template included, as verl feeds the cut ids), or stops the feed
    naming it (``error``)."""
    tokenizer = load_tokenizer(cfg.tokenizer or "tiny")
    render, limit, out = ChatRenderer(tokenizer), cfg.max_prompt_length, []
    for p in prompts:
        ids = tokenizer(render.prompt_text(p.prompt), add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            out.append(p)
        elif cfg.filter_overlong_prompts:
            continue
        elif cfg.truncation == "error":
            raise FeedError(f"prompt {p.extra_info.get('index')} has {len(ids)} tokens, more than "
                            f"feed.max_prompt_length ({limit}, verl's data.max_prompt_length): set "
                            f"data.filter_overlong_prompts=True or data.truncation=left|right|middle")
        else:
            half = limit // 2
            cut = {"left": ids[-limit:], "right": ids[:limit],
                   "middle": ids[:half] + ids[len(ids) - (limit - half):]}[cfg.truncation]
            out.append(dataclasses.replace(p, prompt=tokenizer.decode(cut)))
    return out


def feed_group_ids(cfg: FeedConfig) -> list[str]:
    """The group ids the feed publishes, over all its epochs, in the order it publishes them:
    the learner ends the run when every one is finished (``learner.end_with_data``) and records
    the finished ones by their position here (``resume.pack_finished``)."""
    return [p.group_id for p in build_prompts(cfg)]
