"""On-policy distillation on the stream: a teacher consumer group (``streamrl teacher``) that
annotates each trajectory with the teacher's log-probs, and the learner's distillation losses
(``streamrl.learner.losses``, verl's ``distillation.distillation_loss.*``). See
docs/guides/distillation.md."""
