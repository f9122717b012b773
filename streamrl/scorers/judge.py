"""The LLM judge (generative reward model) over the OpenAI-compatible chat API.

One call scores one trajectory: the prompt template is filled with the prompt, the response and
the ground truth, sent to ``/v1/chat/completions`` on the server the router picks, and the score
is parsed out of the answer with a regex. How failures come out, so that a score is never a
silent 0:

- the answer has no score (or one out of range): ``Failure("judge_unparseable" / ...)``; the
  stage retries a bounded number of times, then dead-letters the record with that reason;
- the server rejects the request (4xx other than 429): ``Failure("judge_rejected")``;
- timeouts, connection errors, 5xx, 429: retried on another server with exponential backoff and
  jitter (tenacity), counted against the server (ejection, see ``router``); when the retries
  run out or every server is ejected: ``Unavailable``, the stage holds the record.

Concurrency is bounded per member (``concurrency``); requests and tokens per minute are bounded
for the whole consumer group (``rpm`` / ``tpm``, this member's share follows its partitions,
``set_share``). The API key is read from the environment variable named by ``api_key_env`` and
only ever goes into the Authorization header: never into a log line, a metric or a record.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from streamrl.errors import ConfigError, Failure
from streamrl.scorers.ratelimit import RateLimiter
from streamrl.servers.router import Router


DEFAULT_TEMPLATE = """You are grading a student's answer.

Question:
{prompt}

Reference answer:
{ground_truth}

Student's answer:
{response}

Judge whether the student's final answer is correct and well reasoned. End your reply with a
line of the form "Score: N" where N is an integer from 0 (wrong) to 10 (fully correct)."""

_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")


@dataclass
class JudgeConfig:
    """One LLM judge. ``urls`` are server roots or OpenAI base URLs (``http://h:8000`` or
    ``http://h:8000/v1``); several URLs are balanced by the router."""

    urls: list[str] = field(default_factory=list)  # server roots or OpenAI base URLs, balanced by the router
    model: str = ""  # the model name sent in each request
    prompt_template: str = DEFAULT_TEMPLATE  # {prompt} {response} {ground_truth}
    system_prompt: str = ""  # a system message before the prompt; empty: none
    score_regex: str = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"  # one group; last match wins
    score_min: float = 0.0  # the judge's scale; the score is normalised to [0, 1]
    score_max: float = 10.0  # the top of the judge's scale (normalised to 1)
    max_tokens: int = 512  # of the judge's reply
    temperature: float = 0.0  # the judge's sampling temperature
    api_key_env: str = ""  # NAME of the environment variable holding the key; "" = no key
    concurrency: int = 32  # requests in flight from this member
    timeout_s: float = 60.0  # per request
    max_retries: int = 3  # per record, on another server where there is one
    backoff_s: float = 0.5  # first retry's wait; doubles each time, plus up to as much jitter
    backoff_max_s: float = 10.0  # the longest wait between retries
    rpm: float = 0.0  # requests per minute for the whole consumer group; 0 = no limit
    tpm: float = 0.0  # tokens per minute for the whole group (estimated, corrected by usage)
    health_path: str = "/v1/models"  # GET on each server root; OpenAI, vLLM and SGLang all serve it
    health_interval_s: float = 5.0  # how often each server's health_path is checked
    eject_after: int = 3  # consecutive failures
    max_reply_bytes: int = 1024 * 1024  # a longer reply fails the record (bad_reply), unread

    def validate(self, name: str = "judge") -> None:
        """Fail at start, naming the field."""
        if not self.urls:
            raise ConfigError(f"config field '{name}.urls': at least one judge URL is needed")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"config field '{name}.urls': {url!r} is not an http(s) URL")
        if "{response}" not in self.prompt_template:
            raise ConfigError(f"config field '{name}.prompt_template': has no {{response}} placeholder")
        try:
            groups = re.compile(self.score_regex).groups
        except re.error as exc:
            raise ConfigError(f"config field '{name}.score_regex': {exc}") from None
        if groups != 1:
            raise ConfigError(f"config field '{name}.score_regex': needs exactly one capture group "
                              f"(the number), has {groups}")
        if self.score_max <= self.score_min:
            raise ConfigError(f"config field '{name}.score_max': must be above score_min")
        for f in ("concurrency", "max_tokens", "eject_after", "max_reply_bytes"):
            if getattr(self, f) < 1:
                raise ConfigError(f"config field '{name}.{f}': must be at least 1")
        for f in ("rpm", "tpm", "max_retries", "backoff_s", "backoff_max_s", "health_interval_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"config field '{name}.{f}': must not be negative")
        if self.timeout_s <= 0:
            raise ConfigError(f"config field '{name}.timeout_s': must be positive")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ConfigError(f"config field '{name}.api_key_env': the environment variable "
                              f"{self.api_key_env} is not set")


def render_prompt(prompt: Any) -> str:
    """A trajectory's prompt (text or chat messages) as text for the judge's template."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, dict)
                         else str(m) for m in prompt)
    return "" if prompt is None else str(prompt)


class JudgeScorer:
    """Async scorer with verl's signature: ``await judge(data_source, solution_str,
    ground_truth, extra_info=None, prompt=None)`` -> ``{"score": float in [0, 1],
    "judge_score_raw": float, "judge_verdict": str}``. The prompt comes from the ``prompt``
    keyword (the reward stage passes the trajectory's), else ``extra_info["prompt"]``.

    ``await start()`` before the first call, ``await close()`` at the end."""

    def __init__(self, config: JudgeConfig, name: str = "judge"):
        config.validate(name)
        self.config, self.name = config, name
        self._regex = re.compile(config.score_regex)
        headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
        self._headers = headers
        auth = {k: v for k, v in headers.items() if k == "Authorization"}
        self.router = Router(list(config.urls), name=name, health_path=config.health_path,
                             health_interval_s=config.health_interval_s,
                             health_timeout_s=min(config.timeout_s, 5.0),
                             eject_after=config.eject_after, headers=auth,
                             max_reply_bytes=config.max_reply_bytes)
        self.limiter = RateLimiter(config.rpm, config.tpm, name=name)
        self._sem = asyncio.Semaphore(config.concurrency)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:  # never the headers
        return f"JudgeScorer({self.name!r}, urls={list(self.router.servers)})"

    async def start(self) -> "JudgeScorer":
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.config.concurrency + 8))
            await self.router.start(self._session)
        return self

    async def close(self) -> None:
        await self.router.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_share(self, fraction: float) -> None:
        """This member's share of the group's partitions: its slice of the RPM / TPM budget."""
        self.limiter.set_share(fraction)

    async def router_address(self) -> str:
        """``HOST:PORT`` of a local proxy over this judge's servers (verl's
        ``reward_router_address`` for async user scorers)."""
        return await self.router.start_proxy()

    # -- scoring -----------------------------------------------------------------------------
    def build_messages(self, prompt: Any, response: str, ground_truth: Any) -> list[dict]:
        values = {"prompt": render_prompt(prompt), "response": response or "",
                  "ground_truth": "" if ground_truth is None else str(ground_truth)}
        # One pass, so a placeholder written inside the response is never expanded.
        text = _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.config.prompt_template)
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return messages + [{"role": "user", "content": text}]

    def parse_score(self, text: str) -> tuple[float, float]:
        """(normalised score in [0, 1], the judge's raw number). The last match wins: judges
        reason first and conclude last."""
        found = self._regex.findall(text or "")
        if not found:
            tail = (text or "")[-200:]
            raise Failure("judge_unparseable",
                             f"no score matching {self.config.score_regex!r} in the judge's answer: {tail!r}")
        raw = float(found[-1])
        lo, hi = self.config.score_min, self.config.score_max
        if not lo <= raw <= hi:
            raise Failure("judge_out_of_range", f"score {raw} outside [{lo}, {hi}]")
        return (raw - lo) / (hi - lo), raw

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict | None = None, **kwargs: Any) -> dict:
        if self._session is None:
            raise RuntimeError(f"{self!r}: await start() first")
        prompt = kwargs.get("prompt")
        if prompt is None and extra_info:
            prompt = extra_info.get("prompt")
        body = {"messages": self.build_messages(prompt, solution_str, ground_truth),
                "max_tokens": self.config.max_tokens, "temperature": self.config.temperature}
        if self.config.model:
            body["model"] = self.config.model
        payload = orjson.dumps(body)
        estimate = len(payload) // 4 + self.config.max_tokens  # ~4 characters a token
        async with self._sem:
            text, used = await self._complete(payload, estimate)
        score, raw = self.parse_score(text)
        out: dict[str, Any] = {"score": score, "judge_score_raw": raw, "judge_verdict": text[-1000:]}
        if used is not None:
            out["judge_tokens"] = used
        return out

    async def _complete(self, payload: bytes, estimate: int) -> tuple[str, int | None]:
        c = self.config
        answer = await self.router.post_json(
            "/v1/chat/completions", payload, headers=self._headers, parse=_parse_completion,
            max_retries=c.max_retries, backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s,
            rejected="judge_rejected", before_attempt=lambda: self.limiter.acquire(estimate))
        text, used = answer
        self.limiter.settle(estimate, used)
        return text, used


def _parse_completion(answer: Any) -> tuple[str, int | None]:
    """(the message text, total tokens used if reported) of a chat completion; raises on any
    other shape (null content, no choices): the router retries it elsewhere, then fails this
    record alone (``BadReply``), never the server."""
    text = answer["choices"][0]["message"]["content"]
    if not isinstance(text, str):
        raise TypeError("message content is not text")
    usage = answer.get("usage") or {}
    used = usage.get("total_tokens") if isinstance(usage, dict) else None
    return text, used if isinstance(used, int) else None
