"""``streamrl gateway``: an agent written in any framework trains on the stream by pointing its
OpenAI client's ``base_url`` at ``http://HOST:PORT/episodes/<episode id>/v1``.

Each ``POST .../chat/completions`` of an episode is served from the rollout backend (the fleet
of inference servers, or an in-process engine) on the episode's token context, never a
re-tokenisation of its text: the first call's messages are rendered once (the chat template,
with the request's ``tools``); each later call must extend the conversation the gateway has
seen (its earlier messages, then the assistant messages it answered, as the agent got them
back), and only the new messages (tool answers, the user's turn) are rendered and appended
(mask 0). What the policy samples is appended exactly (mask 1), with its log-probs and the
version of the weights that decoded each token (``agent_loops.server.EpisodeServer``; a newer
policy version announced on the policy topic is loaded between calls, as in a rollout worker).

``POST /episodes/<id>/end`` with ``{"reward": r}`` (or no reward: the reward group scores it by
``data_source`` and ``ground_truth``, which the body may give, with ``extra_info``,
``group_id`` and ``group_size``) publishes the episode's trajectory to ``rollouts`` and answers
only once the broker has it: a finished episode that was acknowledged is never lost, and its
trajectory id is the episode id (a repeated end is answered again without a second record).
An episode with no call for ``rollout.gateway.episode_timeout_s`` goes to dead letters
(``episode_abandoned``, its trajectory so far as the original bytes). With
``rollout.gateway.state_dir`` every open episode is journalled after each call, and a restarted
gateway takes them up again (their timeout counts from the restart).

Tool calls in the sampled text (Hermes ``<tool_call>``) come back as the message's
``tool_calls``; one choice per request (``n`` 1). Sampling is the rollout section's
(``temperature``, ``top_p``; ``max_tokens`` up to ``max_new_tokens``), whatever the request
asks: the learner trains on log-probs at the rollout's temperature.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import orjson
from aiohttp import web

from streamrl import metrics
from streamrl.bus import Bus
from streamrl.errors import Failure
from streamrl.records import ROLLOUTS, DeadLetter, Trajectory
from streamrl.rollout.agent_loops.base import context_ids, render_ids
from streamrl.rollout.agent_loops.server import Call, EpisodeServer
from streamrl.rollout.backends import BackendError, BackendUnavailable, SamplingParams
from streamrl.rollout.tools import ToolCall, parse_tool_calls

log = logging.getLogger(__name__)

STAGE = "gateway"
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_TOOL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.S)


@dataclass
class Episode:
    """One agent's episode as the gateway has it: the conversation it has seen, the token
    context (``prompt_ids`` then the response tokens with their ``mask``) and every call."""

    id: str
    prompt: list[dict[str, Any]] = field(default_factory=list)  # the first call's messages
    messages: list[dict[str, Any]] = field(default_factory=list)  # ... and everything since
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    busy: bool = False  # a call of this episode is being served (its calls are one at a time)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_json(self) -> dict[str, Any]:
        """The journal's form (``dataclasses.asdict`` deep-copies every token list: measured
        ~30x slower, on the event loop)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("calls", "last_seen", "busy")}
        out["calls"] = [vars(c) for c in self.calls]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Episode":
        calls = [Call(**c) for c in data.pop("calls", [])]
        return cls(**data, calls=calls)


def same_turn(seen: dict[str, Any], given: dict[str, Any]) -> bool:
    """A message the agent sent back is the one the gateway saw (role and text; an assistant
    message's text may come back as null when it only called tools)."""
    if seen.get("role") != given.get("role"):
        return False
    if seen.get("role") == "assistant":
        return (seen.get("content") or "") == (given.get("content") or "")
    return seen.get("content") == given.get("content")


class Gateway:
    """The gateway's episodes and HTTP app over one rollout worker's backend and policy
    following (``RolloutWorker``: its backend, ``sync_weights`` and producer; its prompt loop
    never runs)."""

    name: ClassVar[str] = STAGE

    def __init__(self, bus: Bus, cfg: Any, backend: Any = None):
        from streamrl.rollout.worker import RolloutWorker

        self.bus, self.cfg, self.gcfg = bus, cfg, cfg.gateway
        self.worker = RolloutWorker(bus, cfg, backend=backend)
        self.backend = self.worker.backend
        self.tokenizer = self.backend.tokenizer or self.worker.agents.tokenizer()
        self.episodes: dict[str, Episode] = {}
        self.finished: dict[str, str] = {}  # episode id -> its trajectory id (a repeated end)
        self.state_dir = Path(self.gcfg.state_dir) if self.gcfg.state_dir else None
        self.port: int | None = None
        self.published = self.abandoned = 0
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post("/episodes/{eid}/v1/chat/completions", self.chat)
        self.app.router.add_post("/episodes/{eid}/end", self.end)
        self.app.router.add_get("/episodes/{eid}", self.show)
        self.app.router.add_get("/health", self.health)

    @classmethod
    def from_config(cls, cfg: Any, bus: Bus) -> "Gateway":
        return cls(bus, cfg.rollout)

    def validate(self) -> None:
        self.cfg.validate()

    def describe(self) -> str:
        where = f"http://{self.gcfg.host}:{self.port or self.gcfg.port}/episodes/<id>/v1"
        return (f"{where}, backend {self.cfg.backend}, {len(self.episodes)} open, {self.published} published, "
                f"{self.abandoned} abandoned")

    # -- the journal -----------------------------------------------------------------------------

    def _path(self, eid: str, suffix: str) -> Path:
        assert self.state_dir is not None
        return self.state_dir / f"{eid}.{suffix}"

    def _save(self, ep: Episode) -> None:
        if self.state_dir is None:
            return
        tmp = self._path(ep.id, "tmp")
        tmp.write_bytes(orjson.dumps(ep.to_json()))
        os.replace(tmp, self._path(ep.id, "json"))

    def _finish(self, ep: Episode, trajectory_id: str) -> None:
        self.episodes.pop(ep.id, None)
        self.finished[ep.id] = trajectory_id
        if self.state_dir is not None:
            self._path(ep.id, "done").write_text(trajectory_id)
            self._path(ep.id, "json").unlink(missing_ok=True)

    def _load(self) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for done in self.state_dir.glob("*.done"):
            self.finished[done.stem] = done.read_text()
        for path in self.state_dir.glob("*.json"):
            try:
                ep = Episode.from_json(orjson.loads(path.read_bytes()))
            except (ValueError, TypeError) as exc:
                log.error("gateway: %s is not an episode (%s): left where it is", path, exc)
                continue
            if ep.id in self.finished:
                path.unlink(missing_ok=True)
            else:
                self.episodes[ep.id] = ep
        if self.episodes:
            print(f"{STAGE}: took up {len(self.episodes)} open episodes from {self.state_dir}", flush=True)

    # -- HTTP ------------------------------------------------------------------------------------

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind}}, status=status)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "open": len(self.episodes)})

    async def show(self, request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        if eid in self.finished:
            return web.json_response({"id": eid, "state": "published", "trajectory_id": self.finished[eid]})
        ep = self.episodes.get(eid)
        if ep is None:
            return self._error(404, f"no episode {eid!r}", "not_found_error")
        return web.json_response({"id": eid, "state": "open", "calls": len(ep.calls),
                                  "prompt_tokens": len(ep.prompt_ids), "response_tokens": len(ep.response_ids)})

    async def chat(self, request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        if not _ID.match(eid):
            return self._error(400, "an episode id is 1-128 characters of letters, digits and _ . : -")
        if eid in self.finished:
            return self._error(409, f"episode {eid!r} has ended (published)")
        try:
            body = await request.json()
        except ValueError:
            return self._error(400, "the body is not JSON")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return self._error(400, "'messages' must be a non-empty list of messages")
        if body.get("n", 1) != 1:
            return self._error(400, "one choice per request here ('n' 1)")
        ep = self.episodes.get(eid)
        if ep is None:
            if len(self.episodes) >= self.gcfg.max_episodes:
                return self._error(429, f"{len(self.episodes)} episodes open (rollout.gateway.max_episodes)",
                                   "rate_limit_error")
            ep = Episode(id=eid, prompt=[dict(m) for m in messages], tools=body.get("tools") or None)
            ep.prompt_ids = render_ids(self.tokenizer, ep.prompt, ep.tools)
            self.episodes[eid] = ep
            new_ids: list[int] = []
        elif ep.busy:
            return self._error(409, f"a call of episode {eid!r} is still being served: an episode's calls are one "
                                    "at a time")
        else:
            seen = len(ep.messages)
            if len(messages) <= seen or not all(same_turn(a, b) for a, b in zip(ep.messages, messages)):
                return self._error(409, "the messages must extend the episode's conversation (every earlier "
                                        "message, then the assistant's answers as the gateway sent them)")
            new_ids = context_ids(self.tokenizer, ep.messages, messages[seen:], ep.context, ep.tools)
        ep.last_seen = time.monotonic()
        ep.busy = True
        t0 = time.monotonic()
        try:
            answer = await self._serve(ep, body, messages, new_ids)
        finally:
            ep.busy = False
            ep.last_seen = time.monotonic()
            metrics.GATEWAY_OPEN.set(len(self.episodes))
        metrics.GATEWAY_CALLS.labels("ok" if answer.status == 200 else str(answer.status)).inc()
        metrics.GATEWAY_CALL_SECONDS.observe(time.monotonic() - t0)
        return answer

    async def _serve(self, ep: Episode, body: dict[str, Any], messages: list[dict[str, Any]],
                     new_ids: list[int]) -> web.Response:
        eid = ep.id
        server = EpisodeServer(self.backend, self._params(body), before_turn=self.worker.sync_weights,
                               calls=ep.calls)
        try:
            # rollout.temperature / top_p, whatever the request asks: the learner recomputes the
            # behaviour log-probs at the rollout's temperature
            out = await server.generate(prompt_ids=ep.context + new_ids, sampling_params={})
        except (BackendError, Failure) as exc:
            if not ep.calls:
                self.episodes.pop(eid, None)
            return self._error(400, str(exc))
        except BackendUnavailable as exc:
            if not ep.calls:
                self.episodes.pop(eid, None)
            return self._error(503, f"the policy servers are unavailable: {exc}", "server_error")
        ep.response_ids += new_ids + out.token_ids
        ep.mask += [0] * len(new_ids) + [1] * len(out.token_ids)
        message, finish = self._message(out.token_ids, out.stop_reason == "completed", len(ep.calls))
        ep.messages = [dict(m) for m in messages] + [message]
        ep.last_seen = time.monotonic()
        self._save(ep)
        return web.json_response({
            "id": f"chatcmpl-{eid}-{len(ep.calls)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.cfg.policy,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(ep.context) - len(out.token_ids), "completion_tokens": len(out.token_ids),
                      "total_tokens": len(ep.context)},
            "system_fingerprint": f"policy-version-{ep.calls[-1].versions[-1] if out.token_ids else 0}"})

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.cfg.max_new_tokens
        return SamplingParams(max_new_tokens=max(1, min(int(limit), self.cfg.max_new_tokens)),
                              temperature=self.cfg.temperature, top_p=self.cfg.top_p, ignore_eos=self.cfg.ignore_eos)

    def _message(self, ids: list[int], stopped: bool, n: int) -> tuple[dict[str, Any], str]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        calls = [c for c in parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False),
                                             self.cfg.multi_turn.format) if isinstance(c, ToolCall)]
        if not calls:
            return {"role": "assistant", "content": text}, "stop" if stopped else "length"
        content = _TOOL_BLOCK.sub("", text).strip() or None
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call_{n}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]}, \
            "tool_calls"

    async def end(self, request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        if eid in self.finished:
            return web.json_response({"id": eid, "trajectory_id": self.finished[eid], "published": True,
                                      "again": True})
        ep = self.episodes.get(eid)
        if ep is None:
            return self._error(404, f"no open episode {eid!r}", "not_found_error")
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return self._error(400, "the body is not JSON")
        if ep.busy:
            return self._error(409, f"a call of episode {eid!r} is still being served")
        if not ep.calls:
            return self._error(409, f"episode {eid!r} has no completion to train on")
        try:
            traj = self.trajectory(ep, body if isinstance(body, dict) else {})
        except (Failure, ValueError, TypeError) as exc:
            return self._error(400, str(exc))
        await self.worker.producer.send_and_wait(traj)  # on the broker before the agent hears it is done
        self._finish(ep, traj.id)
        self.published += 1
        metrics.GATEWAY_EPISODES.labels("published").inc()
        metrics.GATEWAY_OPEN.set(len(self.episodes))
        return web.json_response({"id": eid, "trajectory_id": traj.id, "published": True,
                                  "reward": traj.reward_score})

    def trajectory(self, ep: Episode, body: dict[str, Any]) -> Trajectory:
        """The episode as a trajectory record (``body``: the end call's fields)."""
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not np.isfinite(reward)):
            raise ValueError(f"'reward' {reward!r} is not a finite number")
        extra = body.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise ValueError("'extra_info' must be an object")
        server = EpisodeServer(self.backend, SamplingParams(), calls=ep.calls)
        logprobs, runs = server.stamp(ep.response_ids, ep.mask)
        truth = body.get("ground_truth")
        return Trajectory(
            id=ep.id, group_id=str(body.get("group_id") or ep.id), group_size=int(body.get("group_size") or 1),
            policy_version=min(v for c in ep.calls for v in c.versions) if any(c.versions for c in ep.calls)
            else self.backend.version,
            token_versions=runs.as_field(), data_source=str(body.get("data_source") or self.gcfg.data_source),
            prompt=ep.prompt, response=self.tokenizer.decode(ep.response_ids, skip_special_tokens=True),
            ground_truth=None if truth is None else str(truth),
            extra_info={**extra, "episode_id": ep.id, "generate_calls": len(ep.calls), "source": STAGE},
            prompt_ids=np.asarray(ep.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(ep.response_ids, dtype=np.int32), response_logprobs=logprobs,
            response_mask=np.asarray(ep.mask, dtype=np.uint8), reward_score=None if reward is None else float(reward),
            turns=[{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
                   for m in ep.messages[len(ep.prompt):]],
            timings={"generation_started_at": ep.created_at, "episode_s": time.time() - ep.created_at})

    # -- abandoned episodes ------------------------------------------------------------------------

    async def sweep(self) -> int:
        """Every episode idle past the timeout, to dead letters (its trajectory so far)."""
        now, n = time.monotonic(), 0
        for ep in [e for e in self.episodes.values() if not e.busy and now - e.last_seen > self.gcfg.episode_timeout_s]:
            value = self.trajectory(ep, {}).encode(self.bus.config.max_record_bytes) if ep.calls else None
            detail = (f"episode {ep.id!r}: no call for {self.gcfg.episode_timeout_s:g}s "
                      f"(rollout.gateway.episode_timeout_s) after {len(ep.calls)} completions; never ended")
            await self.worker.producer.send_and_wait(DeadLetter.for_message(
                stage=STAGE, reason="episode_abandoned", detail=detail, topic=self.bus.topic(ROLLOUTS.name),
                partition=None, offset=None, key=ep.id.encode(), value=value, record_id=ep.id))
            self.episodes.pop(ep.id, None)
            if self.state_dir is not None:
                self._path(ep.id, "json").unlink(missing_ok=True)
            self.abandoned += 1
            n += 1
            metrics.GATEWAY_EPISODES.labels("abandoned").inc()
            metrics.BUS_DEADLETTERS.labels(STAGE, "episode_abandoned").inc()
            metrics.GATEWAY_OPEN.set(len(self.episodes))
        return n

    async def run(self, stop: asyncio.Event | None = None) -> None:
        self._load()
        stop = stop or asyncio.Event()
        for part in (self.worker.producer, self.worker.follower):
            await part.start()
        await self.worker.sync_weights()
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.gcfg.host, self.gcfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"{STAGE}: serving http://{self.gcfg.host}:{self.port}/episodes/<id>/v1", flush=True)
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(1.0, self.gcfg.episode_timeout_s / 4))
                except asyncio.TimeoutError:
                    await self.sweep()
        finally:
            await runner.cleanup()
            for part in (self.worker.follower, self.worker.producer):
                await part.stop()
            await self.backend.close()

