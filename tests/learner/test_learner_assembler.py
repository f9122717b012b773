"""The assembler's rules: de-dup, whole groups, the staleness bound, timeouts (pure logic)."""

from __future__ import annotations

import random

from streamrl.learner.assembler import FILTERED, GROUP_OVERFLOW, GROUP_TIMEOUT, STALE, Assembler, Item


def make(max_staleness=1, timeout=10.0, partial=False, window=1000) -> Assembler:
    return Assembler(max_staleness=max_staleness, group_timeout_s=timeout,
                     allow_partial_groups=partial, dedup_window=window)


def item(rid: str, gid: str, size: int = 2, version: int = 0, copy: float | None = 0.0) -> Item:
    return Item(id=rid, group_id=gid, group_size=size, policy_version=version, copy=copy)


def test_groups_complete_and_duplicates_are_skipped():
    a = make()
    assert a.add(item("a1", "a"), 0, 0.0) == ("accepted", [])
    assert a.add(item("a1", "a"), 0, 0.1) == ("duplicate", [])  # waiting in its group
    groups, drops = a.take(1, 0)
    assert groups is None and drops == []
    assert a.add(item("a2", "a"), 0, 0.2)[0] == "accepted"
    groups, _ = a.take(1, 0)
    assert [i.id for i in groups[0].items] == ["a1", "a2"]
    assert a.add(item("a2", "a"), 0, 0.3) == ("duplicate", [])  # finished
    status, drops = a.add(item("a3", "a"), 0, 0.3)  # a third distinct member of a group of 2
    assert status == "dropped" and drops[0].reason == GROUP_OVERFLOW


def test_another_copy_of_an_id_is_regenerated_the_same_copy_a_duplicate():
    """A copy is told apart by the trajectory's created_at: a second one (a rollout worker that
    generated the group again) is ``regenerated``, the same one again (a redelivery) a
    ``duplicate``, whether the id waits in its group, was trained, or was dropped."""
    a = make(max_staleness=0)
    assert a.add(item("a1", "a", copy=1.0), 0, 0.0)[0] == "accepted"
    assert a.add(item("a1", "a", copy=2.0), 0, 0.0) == ("regenerated", [])  # waiting
    assert a.add(item("a1", "a", copy=2.0), 0, 0.0) == ("duplicate", [])
    assert a.add(item("a1", "a", copy=1.0), 0, 0.0) == ("duplicate", [])
    a.add(item("a2", "a", copy=1.0), 0, 0.0)
    assert a.take(1, 0)[0] is not None
    assert a.add(item("a2", "a", copy=3.0), 0, 0.0) == ("regenerated", [])  # trained
    assert a.add(item("a1", "a", copy=2.0), 0, 0.0) == ("duplicate", [])  # the copy seen while waiting
    assert a.add(item("s1", "s", version=0, copy=1.0), 1, 0.0)[0] == "dropped"  # stale
    assert a.add(item("s1", "s", version=0, copy=4.0), 1, 0.0) == ("regenerated", [])
    b = make(max_staleness=0)
    b.load_state_dict(a.state_dict())  # the copies survive a restart
    assert b.add(item("a2", "a", copy=3.0), 0, 0.0) == ("duplicate", [])
    assert b.add(item("a2", "a", copy=5.0), 0, 0.0) == ("regenerated", [])
    c = make()
    c.load_state_dict({"finished": ["a1"], "closed": []})  # a checkpoint from before copies were kept
    assert c.add(item("a1", "a", copy=9.0), 0, 0.0) == ("duplicate", [])  # unknown: never counted twice


def test_take_waits_for_a_full_mini_batch_oldest_first():
    a = make()
    for g in ("x", "y", "z"):
        a.add(item(f"{g}1", g), 0, 0.0)
        a.add(item(f"{g}2", g), 0, 0.0)
    groups, _ = a.take(2, 0)
    assert [g.group_id for g in groups] == ["x", "y"]
    assert a.take(2, 0)[0] is None
    assert a.waiting_records == 2


def test_staleness_bound_on_arrival_and_at_take():
    a = make(max_staleness=1)
    assert a.add(item("s1", "s", version=0), 2, 0.0)[1][0].reason == STALE  # 2 - 0 > 1
    # a late fresh member of a stale group follows its group
    status, drops = a.add(item("s2", "s", version=2), 2, 0.0)
    assert status == "dropped" and drops[0].reason == STALE
    # a stale newcomer takes the waiting members of its group with it
    a.add(item("m1", "m", version=2), 2, 0.0)
    status, drops = a.add(item("m2", "m", version=0), 2, 0.0)
    assert sorted(d.item.id for d in drops) == ["m1", "m2"] and {d.reason for d in drops} == {STALE}
    assert sum(d.closes_group for d in drops) == 1  # one group dropped
    # a complete group that waited while the version moved on is dropped at take
    a.add(item("w1", "w", version=1), 1, 0.0)
    a.add(item("w2", "w", version=2), 2, 0.0)
    groups, drops = a.take(1, 3)
    assert groups is None and sorted(d.item.id for d in drops) == ["w1", "w2"]


def test_max_staleness_zero_is_strictly_on_policy():
    a = make(max_staleness=0)
    assert a.add(item("p1", "p", version=3), 3, 0.0)[0] == "accepted"
    assert a.add(item("q1", "q", size=1, version=2), 3, 0.0)[1][0].reason == STALE
    a.add(item("p2", "p", version=3), 3, 0.0)
    assert a.take(1, 4)[0] is None  # at version 4 the version-3 group is stale


def test_randomised_version_mixes_never_exceed_the_bound():
    rng = random.Random(7)
    for max_staleness in (0, 1, 3):
        a = make(max_staleness=max_staleness)
        version, trained = 0, 0
        for step in range(400):
            gid = f"g{rng.randrange(60)}"
            pv = max(0, version - rng.randrange(0, 6))
            a.add(item(f"r{step}", gid, size=3, version=pv), version, float(step))
            groups, _ = a.take(2, version)
            if groups:
                for g in groups:
                    for it in g.items:
                        assert version - it.policy_version <= max_staleness
                        trained += 1
                if rng.random() < 0.5:
                    version += 1
        assert trained > 0


def test_incomplete_group_times_out_or_trains_partial():
    a = make(timeout=5.0)
    a.add(item("t1", "t", size=3), 0, 0.0)
    a.add(item("t2", "t", size=3), 0, 1.0)
    assert a.expire(4.9) == []
    drops = a.expire(5.0)
    assert sorted(d.item.id for d in drops) == ["t1", "t2"] and {d.reason for d in drops} == {GROUP_TIMEOUT}
    assert a.add(item("t3", "t", size=3), 0, 6.0)[1][0].reason == GROUP_TIMEOUT  # too late

    p = make(timeout=5.0, partial=True)
    p.add(item("t1", "t", size=3), 0, 0.0)
    p.add(item("t2", "t", size=3), 0, 1.0)
    assert p.expire(6.0) == []
    groups, _ = p.take(1, 0)
    assert [i.id for i in groups[0].items] == ["t1", "t2"]
    assert p.add(item("t3", "t", size=3), 0, 7.0)[1][0].reason == GROUP_TIMEOUT


def test_state_survives_and_window_is_bounded():
    a = make(window=3)
    for g in "abc":
        a.add(item(f"{g}1", g), 0, 0.0)
        a.add(item(f"{g}2", g), 0, 0.0)
    a.take(3, 0)
    a.add(item("w1", "w"), 0, 0.0)  # waiting, not finished: must come back after a restart
    b = make(window=3)
    b.load_state_dict(a.state_dict())
    assert b.add(item("c2", "c"), 0, 0.0)[0] == "duplicate"
    assert b.add(item("a1", "a2-new"), 0, 0.0)[0] == "accepted"  # fell out of the window of 3
    assert b.add(item("w1", "w"), 0, 0.0)[0] == "accepted"


def test_flat_groups_are_filtered_before_they_count_and_the_bound_lets_them_train():
    """DAPO's dynamic sampling: a whole group whose metric does not vary is dropped
    ``filtered`` (the gate counts it finished) and never becomes ready; past ``filter_bound``
    groups a version, flat groups train; a new version counts afresh."""
    a = Assembler(max_staleness=0, group_timeout_s=60, allow_partial_groups=False, dedup_window=100,
                  filter_flat=True, filter_bound=2)

    def add(gid: str, metrics: list[float]) -> list:
        drops = []
        for i, m in enumerate(metrics):
            it = item(f"{gid}{i}", gid, size=len(metrics))
            it.metric = m
            drops += a.add(it, 0, 0.0)[1]
        return drops

    assert add("mixed", [1.0, 0.0]) == [] and list(a.ready) == ["mixed"]
    flat = add("flat", [1.0, 1.0])
    assert [d.reason for d in flat] == [FILTERED, FILTERED] and flat[0].closes_group and "flat" not in a.ready
    assert [d.reason for d in add("late", [1.0])] == []  # a group of one is kept (it has no variance to lack)
    assert add("zero", [0.0, 0.0]) and a.filtered == 2
    assert add("third", [0.5, 0.5]) == [] and "third" in a.ready  # past the bound: it trains
    a.new_version()
    assert add("again", [0.0, 0.0]) and a.filtered == 1
    assert a.add(item("flat0", "flat"), 0, 0.0)[0] == "duplicate"  # a filtered id is finished


def _version(a: Assembler, version: int, now: float) -> None:
    """The learner made ``version`` at running second ``now``."""
    a.new_version(version, now)


def test_the_window_forgets_by_versions_and_running_seconds_and_stays_flat():
    """Issue 68: finished ids and closed groups are kept ``keep_versions`` versions and
    ``keep_seconds`` of running time, then forgotten, so a long run's state is flat; a copy of
    a forgotten id can only be stale by then, and is dropped as stale (never trained)."""
    a = Assembler(max_staleness=1, group_timeout_s=60, allow_partial_groups=False, dedup_window=10**6,
                  keep_versions=3, keep_seconds=5.0)
    sizes = []
    for v in range(200):
        for i in range(4):  # 4 groups of 2 a version
            gid = f"g{v}-{i}"
            a.add(item(f"{gid}a", gid, version=v), v, 0.0)
            a.add(item(f"{gid}b", gid, version=v), v, 0.0)
        assert a.take(4, v)[0] is not None
        _version(a, v + 1, float(v))  # one second a version: the versions' rule is the longer (5 s)
        sizes.append((len(a.finished), len(a.closed)))
    assert max(sizes[100:]) == sizes[-1] and sizes[-1][0] <= 8 * 6 and sizes[-1][1] <= 4 * 6, sizes[-1]
    assert "g199-0a" in a.finished and "g197-0a" in a.finished and "g150-0a" not in a.finished
    # a copy of a forgotten id: its policy_version is far too old to train
    status, drops = a.add(item("g150-0a", "g150-0", version=150), 200, 0.0)
    assert status == "dropped" and drops[0].reason == STALE
    # with few versions a second, the seconds' rule keeps more
    b = Assembler(max_staleness=0, group_timeout_s=60, allow_partial_groups=False, dedup_window=10**6,
                  keep_versions=1, keep_seconds=5.0)
    for v in range(40):
        b.add(item(f"x{v}", f"x{v}", size=1, version=v), v, 0.0)
        b.take(1, v)
        _version(b, v + 1, v * 0.1)  # 10 versions a second: 5 s hold 50 versions
    assert "x0" in b.finished and len(b.finished) == 40
    for v in range(40, 120):
        b.add(item(f"x{v}", f"x{v}", size=1, version=v), v, 0.0)
        b.take(1, v)
        _version(b, v + 1, v * 0.1)
    assert "x60" not in b.finished and "x75" in b.finished and len(b.finished) <= 52


def test_the_window_survives_a_restart_with_its_versions_and_clock():
    a = Assembler(max_staleness=0, group_timeout_s=60, allow_partial_groups=False, dedup_window=1000,
                  keep_versions=3, keep_seconds=0.0)
    for v in range(5):
        a.add(item(f"r{v}", f"r{v}", size=1, version=v), v, 0.0)
        a.take(1, v)
        _version(a, v + 1, 100.0 + v)
    assert sorted(a.finished.data) == ["r3", "r4"]
    b = Assembler(max_staleness=0, group_timeout_s=60, allow_partial_groups=False, dedup_window=1000,
                  keep_versions=3, keep_seconds=0.0)
    b.load_state_dict(a.state_dict(), 5)
    assert b.clock == a.clock == 4.0 and b.finished.data == a.finished.data
    assert b.add(item("r4", "r4", size=1, version=4), 5, 0.0) == ("duplicate", [])
    assert b.add(item("r4", "r4", size=1, version=5, copy=7.0), 5, 0.0) == ("regenerated", [])
    b.new_version(6, 1000.0)  # the pause before the restart is not running time
    assert b.clock == 4.0 and "r4" in b.finished and "r3" not in b.finished  # r4: kept through version 6
    b.new_version(7, 1001.0)
    assert b.clock == 5.0 and "r4" not in b.finished
    old = make()
    old.load_state_dict({"finished": [["o1", [1.0]]], "closed": [["o", "stale"]]}, 9)  # before versions were kept
    assert old.finished.data["o1"] == ([1.0], 9) and old.closed.data["o"] == ("stale", 9)


def test_randomised_redeliveries_never_train_an_id_twice_with_a_bounded_window():
    """Copies of trained records arrive late (a redelivered copy keeps its policy_version; a
    regenerated one is made within the seconds' window), across checkpoint restarts: no id is
    trained twice, and the window stays within its bound."""
    rng = random.Random(68)
    staleness, per_version, keep_s = 2, 6, 3.0
    a = Assembler(max_staleness=staleness, group_timeout_s=1e9, allow_partial_groups=False, dedup_window=10**6,
                  keep_seconds=keep_s)
    trained: list[str] = []
    made: list[tuple[str, str, int, float, float]] = []  # id, group, policy_version, copy, made at (s)
    now, version, peak = 0.0, 0, 0
    for step in range(3000):
        now += rng.uniform(0.01, 0.3)
        if rng.random() < 0.5:  # a new group of 2 from the current policy
            gid = f"g{step}"
            for m in "ab":
                made.append((gid + m, gid, version, now, now))
        pending = []
        for rid, gid, pv, copy, _at in made[-40:]:
            if rng.random() < 0.3:
                pending.append((rid, gid, pv, copy))
        for rid, gid, pv, copy in pending:
            if rng.random() < 0.1:  # regenerated: a new copy, from the policy of now
                copy, pv = copy + 0.5, version
            a.add(Item(rid, gid, 2, pv, copy=copy), version, now)
        groups, _ = a.take(per_version // 2, version)
        if groups:
            trained += [i.id for g in groups for i in g.items]
            version += 1
            a.new_version(version, now)
            if rng.random() < 0.05:  # a restart from the checkpoint
                state = a.state_dict()
                a = Assembler(max_staleness=staleness, group_timeout_s=1e9, allow_partial_groups=False,
                              dedup_window=10**6, keep_seconds=keep_s)
                a.load_state_dict(state, version)
                a.tick(now)
        made = [m for m in made if now - m[4] < keep_s]  # nothing is regenerated after keep_seconds
        peak = max(peak, len(a.finished))
    assert version > 100 and len(trained) == len(set(trained)), "an id trained twice"
    assert peak < 400, peak  # ~ (staleness + 2 versions, or ~3 s of them) * their records, not the run's


def test_the_feeds_finished_groups_take_a_bit_each_and_read_back_whole():
    """Issue 68: the checkpoint listed every prompt group the run finished (~580 bytes more per
    version of the main job, rewritten at every checkpoint). By position in the feed's order it
    is a bit each: 2,000 versions' groups, finished out of order as rollout workers finish them,
    fit in a few KB and read back exactly; a group the order does not hold stays by id; another
    feed's order is refused (its finished prompts could be fed again), more epochs after it are
    not."""
    import json
    from dataclasses import asdict

    import pytest

    from streamrl import resume
    from streamrl.feed.prompts import group_id

    order = [group_id("digits", epoch, i, f"inc {i}=") for epoch in range(2) for i in range(16_000)]
    rng = random.Random(0)
    done: set[str] = set()
    state = resume.LearnerState()
    for v in range(2000):  # 16 groups a version, each up to 64 positions late
        done.update(order[min(len(order) - 1, 16 * v + rng.randrange(64))] for _ in range(16))
        if v % 250 == 0:
            resume.pack_finished(state, done | {"outside-the-feed"}, order)
    resume.pack_finished(state, done | {"outside-the-feed"}, order)
    size = len(json.dumps(asdict(state)))
    listed = len(json.dumps(sorted(done)))
    assert size < 8_000 and size * 50 < listed, (size, listed)  # the ids took ~0.7 MB
    back = resume.LearnerState(**json.loads(json.dumps(asdict(state))))  # as state.json holds it
    assert resume.finished(back, order) == done | {"outside-the-feed"}
    assert resume.finished_count(back) == len(done) + 1 and back.done_groups == ["outside-the-feed"]
    assert resume.finished(back, order + [group_id("digits", 2, 0, "inc 0=")]) == done | {"outside-the-feed"}
    for other in (order[1:], order[:100], None):
        with pytest.raises(resume.FeedChanged, match="another feed"):
            resume.finished(back, other)
    # without the feed's order (a learner that could not read it) earlier bits stay, new ids are kept by id
    resume.pack_finished(back, {"late"}, None)
    assert resume.finished(back, order) == done | {"late"}
