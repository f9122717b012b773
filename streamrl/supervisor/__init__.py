"""The supervisor of ``streamrl run``: the run's steps, the launchers that start and keep its
stages running, and its watch over the topics.

- ``run``: the command's steps, one function each: plan (arguments, config, run directory),
  start the stages, watch, stop them in order, report a failure, summarise;
- ``observer``: what the topics say about the run (``Observer``, ``Observation``), and the
  records each group member committed (``MemberRecords``);
- ``display``: the status line, the summary, its plot and its last line;
- ``launcher``: ``Launcher`` (start, supervise, restart, stop named stages) and
  ``LocalLauncher`` (child processes);
- ``ray_launcher``: ``RayLauncher`` (stages as Ray actors); ``placement``: where Ray may put
  them, worked out without Ray.

Each stage's consumer lag gauges are the bus's (``streamrl.bus.lag.ConsumerLag``): the stages
export them, the supervisor only reads the topics and the stages' metrics.
"""
