"""The run's main loop (``observe_until``): poll the topics, supervise the stages, autoscale,
show the status, until the learner is done, a stage fails, the broker goes away or the user
stops the run; and, when nothing moves, what each stage waits on (``diagnose``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from streamrl.supervisor.autoscale import Autoscale
from streamrl.supervisor.display import status_line
from streamrl.supervisor.launcher import Launcher
from streamrl.supervisor.observer import Observation, Observer, scrape

log = logging.getLogger(__name__)


def cancelling() -> bool:
    """Whether the running task itself is being cancelled (not a Kafka client's own
    cancellation leaking out of a call; Python 3.10 cannot tell: then never)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


@dataclass
class Watch:
    """What ``observe_until`` watches besides the stages, its limits (``run.*`` keys), and what
    it does on the way: show the status, keep the observation, resize the reward group."""

    target_versions: int = 0  # learner.versions, for the status line
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # Ctrl-C, SIGTERM
    broker_exited: Callable[[], str | None] = lambda: None  # the embedded broker: None while it runs
    bootstrap: str = ""
    learner_ended: Callable[[], str] = lambda: "done"  # why the learner exited 0
    show: Callable[[str], None] = lambda line: None  # a status line, or an event of the stages
    status_interval_s: float = 5.0
    # called with the observation when its figures move, at most once a second
    keep: Callable[[Observation], None] | None = None
    autoscale: Autoscale | None = None  # the reward group sized by its lag
    stall_warn_s: float = 60.0
    stall_timeout_s: float = 0.0  # 0: off
    unavailable_timeout_s: float = 300.0  # 0: wait for the broker forever
    poll_timeout_s: float = 5.0
    diagnose_every_s: float = 5.0
    failure: str = ""  # one line: why the run failed or stalled (set when it returns so)
    unreachable: bool = False  # the broker did not answer at the last poll (stops cannot drain)


@dataclass
class _Progress:
    """What ``observe_until`` remembers from one poll to the next."""

    moved_at: float = field(default_factory=time.monotonic)  # when a figure last moved
    figures: tuple = ()
    warned: bool = False  # the stall warning was shown (once per stall)
    shown_at: float = 0.0
    diagnosed_at: float = 0.0
    kept_at: float = 0.0
    unreachable_since: float | None = None
    errors: list[str] = field(default_factory=list)  # from the last diagnosis
    waits: list[str] = field(default_factory=list)
    supervising: asyncio.Future | None = None  # the launcher's supervision, in its thread


#: how long one pass of the loop waits for the launcher's supervision before it goes on (the
#: supervision goes on in its thread; its events are shown when it ends)
SUPERVISE_WAIT_S = 0.5


#: what the stages' ``streamrl_stage_waiting{on=...}`` means, for the status line
WAITING_WORDS = {"staleness_gate": "the staleness gate (closed at its limit until the learner trains)",
                 "records": "rewarded records (fewer whole groups than a mini-batch)",
                 "incomplete_groups": "incomplete groups (members still being generated or scored)",
                 "filtered_groups": "groups with variance (every whole group so far was filtered: "
                                    "learner.filter_groups; raise max_num_gen_batches's bound or wait)"}


REFUSAL_WORDS = {"not_allowed": "its weights_uri is not under rollout.weights_prefixes",
                 "no_uri": "it has no weights_uri", "load_failed": "the weights did not load (see its log)"}


#: the samples ``diagnose`` reads from each stage's metrics
DIAGNOSED = ("streamrl_stage_waiting", "streamrl_rollout_weights", "streamrl_rollout_servers")


async def diagnose(launcher: Launcher, obs: Observation,
                   observer: Observer | None = None) -> tuple[list[str], list[str]]:
    """Errors (a rollout worker refusing weights) and the rollout servers' state, both always on
    the status line, and what each stage waits on, read from the stages' own metrics and from the
    topics (with ``observer``: which partitions of ``rollouts``
    hold the records the reward group has not committed past)."""
    errors, waits = [], []
    servers: dict[str, int] = {}  # rollout servers by state, over every worker's fleet
    urls = {}
    for name in launcher.names():
        if launcher.returncode(name) is not None:
            if name == "feed" and launcher.returncode(name) == 0:
                waits.append(f"feed: done ({obs.prompts} prompts published)")
            continue
        url = launcher.metrics_url(name)
        if not url:
            waits.append(f"{name} is starting")
            continue
        urls[name] = url
    # all at once: a stage that does not answer costs its one-second timeout once, not once each
    scraped = await asyncio.gather(*(asyncio.to_thread(scrape, url, DIAGNOSED) for url in urls.values()),
                                   return_exceptions=True)
    for name, samples in zip(urls, scraped):
        if isinstance(samples, BaseException):  # starting, restarting, or busy: next time
            continue
        for metric, labels, value in samples:
            if metric == "streamrl_rollout_servers":
                servers[labels.get("state", "")] = servers.get(labels.get("state", ""), 0) + int(value)
            if metric == "streamrl_rollout_weights_refused_version" and value >= 0:
                errors.append(f"ERROR {name} refuses policy version {value:.0f}: "
                              f"{REFUSAL_WORDS.get(labels.get('reason', ''), labels.get('reason'))}")
            elif metric == "streamrl_stage_waiting" and value == 1:
                waits.append(f"{name} waits on {WAITING_WORDS.get(labels.get('on', ''), labels.get('on'))}")
    if obs.unscored > 0:
        waits.append(f"reward: {obs.unscored} rollouts not scored yet"
                     + (await _backlog_words(observer) if observer is not None else ""))
    if sum(servers.values()):  # always on the line, as errors are: a fleet loading or out explains much
        errors.append(f"rollout servers: {servers.get('latest', 0)} on the latest version, "
                      f"{servers.get('loading', 0)} loading, {servers.get('out', 0)} out")
    return errors, waits


async def _backlog_words(observer: Observer) -> str:
    """Where the records the reward group has not consumed are (it says nothing if the group's
    offsets cannot be read: the rest of the diagnosis still stands)."""
    try:
        backlog = await asyncio.wait_for(observer.reward_backlog(), 5)
    except (Exception, asyncio.TimeoutError):
        return ""
    if not backlog:
        return ""
    spans = ", ".join(f"{p} ({end - committed} from offset {committed})" for p, (committed, end) in backlog.items())
    return f"; group {observer.reward_group} has not consumed partition(s) {spans}"


async def observe_until(observer: Observer, launcher: Launcher, watch: Watch | None = None) -> str:
    """Poll and show status until the learner exits (its reason: ``done`` at its versions,
    ``data_exhausted``), a stage fails past its restarts, the broker goes away, or ``watch.stop``;
    restart crashed stages and resize the reward group on the way (``watch.autoscale``).
    Returns why it ended: ``done``, ``data_exhausted``, ``interrupted``, ``stalled``,
    ``failed:broker`` or ``failed:<stage>`` (``watch.failure`` says why in one line).

    Nothing waits in silence: when no figure moves for ``watch.stall_warn_s`` the status line
    says what each stage waits on; errors (weights refused) are on it as soon as seen.

    ``watch.keep(obs)`` is called when the figures move, at most once a second: the run saves what
    it observed, so a session SIGKILLed later is still in the resumed run's summary and plot."""
    watch = watch or Watch()
    progress = _Progress()
    while True:
        gone = watch.broker_exited()
        if gone:
            watch.failure = f"{gone}: stopping every stage"
            return "failed:broker"
        obs = await _poll(observer, watch, progress)
        if obs is None:
            return "failed:broker"
        if watch.stop.is_set():  # before supervising: a terminal's Ctrl-C reaches the stages too, and
            return "interrupted"  # one that already exited 0 is stopping, not to be restarted
        now = time.monotonic()
        await _supervise(observer, launcher, watch, progress, obs, now)
        _note_progress(obs, watch, progress, now)
        await _show_status(observer, launcher, watch, progress, obs, now)
        ended = _stalled(watch, progress, now) or await _stages_ended(observer, launcher, watch)
        if ended:
            return ended


async def _poll(observer: Observer, watch: Watch, progress: _Progress) -> Observation | None:
    """The topics' figures now; while the broker does not answer, the last ones
    (``watch.unreachable``); None once it has not answered for ``watch.unavailable_timeout_s``."""
    now = time.monotonic()
    try:
        obs = await asyncio.wait_for(observer.poll(), watch.poll_timeout_s)
    except (Exception, asyncio.CancelledError) as exc:  # either client's errors, or no answer in time
        if cancelling():
            raise
        watch.unreachable = True
        if progress.unreachable_since is None:
            progress.unreachable_since = now
            log.warning("run: the broker at %s does not answer (%s)", watch.bootstrap,
                        type(exc).__name__ if isinstance(exc, asyncio.TimeoutError) else exc)
        if watch.unavailable_timeout_s and now - progress.unreachable_since >= watch.unavailable_timeout_s:
            watch.failure = (f"the broker at {watch.bootstrap} did not answer for "
                             f"{now - progress.unreachable_since:.0f} s (bus.unavailable_timeout_s)")
            return None
        return observer.obs
    progress.unreachable_since, watch.unreachable = None, False
    return obs


async def _supervise(observer: Observer, launcher: Launcher, watch: Watch, progress: _Progress,
                     obs: Observation, now: float) -> None:
    """Restart what crashed or stopped answering, count each group member's records, and
    resize the reward group (not while the broker is away: its lag cannot be read). The
    launcher's supervision runs in its own thread, one at a time; the loop waits for it at most
    ``SUPERVISE_WAIT_S`` (a frozen node or a slow Ray holds that thread, never the status line)."""
    if progress.supervising is None:
        progress.supervising = asyncio.ensure_future(asyncio.to_thread(launcher.supervise, now))
    done, _ = await asyncio.wait({progress.supervising}, timeout=SUPERVISE_WAIT_S)
    if done:  # else it goes on in its thread, and this is asked again next time
        finished, progress.supervising = progress.supervising, None
        for event in finished.result():
            watch.show(event)
    await obs.members.scrape(launcher)
    if watch.autoscale is not None and progress.unreachable_since is None:
        await watch.autoscale.step(observer, launcher, now, watch.show)


def _note_progress(obs: Observation, watch: Watch, progress: _Progress, now: float) -> None:
    """When the figures last moved; ``watch.keep(obs)`` when they have, at most once a second."""
    current = (obs.prompts, obs.rollouts, obs.rewarded, obs.trained, sum(obs.deadletters.values()),
               obs.latest_version)
    if current != progress.figures:
        progress.figures, progress.moved_at, progress.warned = current, now, False
    if watch.keep is not None and progress.moved_at > progress.kept_at and now - progress.kept_at >= 1.0:
        watch.keep(obs)  # in the loop, not a thread: the observer's figures do not move under it
        progress.kept_at = now


async def _show_status(observer: Observer, launcher: Launcher, watch: Watch, progress: _Progress,
                       obs: Observation, now: float) -> None:
    """The status line every ``watch.status_interval_s``, and at once when a stall begins, with
    the errors, the broker's absence and (stalled) what each stage waits on."""
    stalled = now - progress.moved_at
    if now - progress.diagnosed_at >= watch.diagnose_every_s:
        progress.diagnosed_at = now
        progress.errors, progress.waits = await diagnose(launcher, obs, observer)
    notes = list(progress.errors)
    if progress.unreachable_since is not None:
        notes.append(f"broker {watch.bootstrap} unreachable for {now - progress.unreachable_since:.0f} s")
    if stalled >= watch.stall_warn_s:
        notes.append(f"nothing moved for {stalled:.0f} s: " + ("; ".join(progress.waits) or "no stage says why"))
    if now - progress.shown_at >= watch.status_interval_s or (stalled >= watch.stall_warn_s and not progress.warned):
        progress.warned = progress.warned or stalled >= watch.stall_warn_s
        watch.show(status_line(obs, watch.target_versions, launcher.restart_count(), " | ".join(notes)))
        progress.shown_at = now


def _stalled(watch: Watch, progress: _Progress, now: float) -> str | None:
    """``stalled`` once nothing moved for ``watch.stall_timeout_s`` (when set)."""
    stalled = now - progress.moved_at
    if watch.stall_timeout_s and stalled >= watch.stall_timeout_s:
        watch.failure = (f"nothing moved for {stalled:.0f} s (run.stall_timeout_s): "
                         + ("; ".join(progress.errors + progress.waits) or "no stage says why"))
        return "stalled"
    return None


async def _stages_ended(observer: Observer, launcher: Launcher, watch: Watch) -> str | None:
    """Why the learner ended (exit 0), after a last poll for its last version's records; or
    ``failed:<stage>`` for a stage past its restarts; None while the run goes on."""
    if launcher.returncode("learner") == 0:
        await asyncio.sleep(1.0)  # the last version's records arrive on the topics
        try:
            await asyncio.wait_for(observer.poll(), watch.poll_timeout_s)
        except (Exception, asyncio.CancelledError):
            if cancelling():
                raise
        return watch.learner_ended()
    failed = launcher.gave_up  # the supervision's finding: asking would supervise here, in the loop
    return f"failed:{failed}" if failed is not None else None
