"""Validation while training (``streamrl eval``): each asked policy version generates the
validation set through the rollout backends, is scored by the reward table in process, and
its verl-named figures (``scores``) go to the ``eval`` topic, one record per data source."""
