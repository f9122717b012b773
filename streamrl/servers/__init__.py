"""Inference servers streamrl talks to, whoever uses them: the reward stage (reward models,
LLM judges, a teacher) and the rollout workers (policy servers).

- ``processes``: servers streamrl launches itself (``reward.servers``,
  ``rollout.servers_launch``): ``ServerConfig``, ``ServerProcesses`` (start, health, restart with
  backoff, stop);
- ``router``: the client side over a set of server URLs (``Router``: least outstanding requests,
  ejection and re-admission on health, ``Retry-After``), used by judges, reward models, the
  teacher and the rollout's ``ServerFleet`` (``streamrl.rollout.fleet``, which adds weight
  updates on top).
"""
