"""The supervisor of ``streamrl run``: the run's steps, the launchers that start and keep its
stages running, and its watch over the topics. ``streamrl.commands.run`` holds the verb's
arguments and calls ``run.run``.

- ``plan``: before anything starts: the command line read, the config resolved and checked
  (``--dry-run``), the run directory (new, or the run to resume), the topics, the warm start;
- ``run``: the run's steps, one function each: open the run, start the stages, watch them,
  stop them in pipeline order, report a failed stage, summarise;
- ``watch``: the main loop (``observe_until``): poll, supervise (in a thread: the loop never
  waits on a stage or on Ray), autoscale, show, until the run ends; what each stage waits on when nothing moves (``diagnose``);
- ``observer``: what the topics say about the run (``Observer``, ``Observation``), and the
  records each group member committed (``MemberRecords``);
- ``display``: the status line, the summary, its plot and its last line;
- ``launcher``: ``Launcher`` (start, supervise, restart, stop named stages; end one silent for
  ``run.stage_timeout_s``) and
  ``LocalLauncher`` (child processes); ``ray_launcher``: ``RayLauncher`` (stages as Ray
  actors); ``placement``: where Ray may put them, worked out without Ray;
- ``autoscale``: the reward group sized by its consumer lag.

Each stage's consumer lag gauges are the bus's (``streamrl.bus.lag.ConsumerLag``): the stages
export them; the supervisor reads the topics and the stages' metrics.
"""
