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
