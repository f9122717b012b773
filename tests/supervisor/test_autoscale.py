"""The reward group's autoscaling policy, on its own (the Ray test drives it end to end)."""

from streamrl.supervisor.autoscale import LagAutoscaler


def test_scales_up_on_sustained_lag_and_down_when_it_is_gone():
    s = LagAutoscaler(min_members=1, max_members=3, scale_up_lag=100, scale_down_lag=0, window_s=5, cooldown_s=10)
    assert s.decide(500, 1, now=0) == 0  # a spike is not a trend
    assert s.decide(500, 1, now=4) == 0
    assert s.decide(500, 1, now=5) == 1  # above the bar for the whole window
    assert s.decide(500, 2, now=6) == 0  # cooldown: the rebalance settles first
    assert s.decide(500, 2, now=14) == 0
    assert s.decide(500, 2, now=15) == 1  # still high once the cooldown is over
    assert s.decide(500, 3, now=40) == 0  # at the maximum
    assert s.decide(0, 3, now=50) == 0
    assert s.decide(0, 3, now=55) == -1  # drained for the whole window
    assert s.decide(0, 2, now=80) == 0
    assert s.decide(0, 2, now=85) == -1
    assert s.decide(0, 1, now=200) == 0
    assert s.decide(0, 1, now=300) == 0  # never below the minimum


def test_lag_between_the_bars_changes_nothing():
    s = LagAutoscaler(min_members=1, max_members=4, scale_up_lag=100, scale_down_lag=0, window_s=1, cooldown_s=0)
    for t in range(20):
        assert s.decide(50, 2, now=t) == 0
