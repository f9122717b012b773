"""Experiment trackers (TensorBoard, MLflow, W&B) fed from the topics: ``trackers`` (what is
logged, under verl's names, once per version) and ``config`` (``tracking:``)."""
