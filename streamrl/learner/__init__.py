"""The learner: consumes ``rewarded``, trains the policy (GRPO / PPO-clip, optionally AReaL's
decoupled objective) under a staleness bound, checkpoints, and announces each version on
``policy``.

Pieces, one concept each: ``config`` (the ``learner:`` section), ``assembler`` (de-duplication,
groups, staleness, timeouts: pure logic), ``losses`` (advantages, policy loss, KL, entropy,
aggregation: pure torch), ``trainer`` (the model, log-probs, one update), ``checkpoint``
(weights + optimizer + version + offsets + de-dup window, atomically), ``samples`` (a rewarded
record to a checked training sample), ``versions`` (which policy announcement is current, lines,
pruning), ``observe`` (the learner's metrics), ``stage`` (the consume / train / publish loop).
torch is imported by ``losses`` and ``trainer`` only; ``stage`` loads the trainer lazily.
"""
