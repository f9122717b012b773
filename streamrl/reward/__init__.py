"""The reward stage: a consumer group on ``rollouts`` that scores trajectories into ``rewarded``.

``config`` (the ``reward:`` section), ``stage`` (one member: ``RewardStage``), ``groups`` (the
group hook) and ``hooks`` (built-in group hooks). Scorers themselves live in ``streamrl.scorers``.
"""
