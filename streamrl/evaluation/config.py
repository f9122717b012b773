"""The eval stage's config section (``eval:`` in a pipeline YAML).

verl's keys map onto it (``streamrl.pipeline_config``): ``data.val_files`` -> ``dataset``,
``trainer.test_freq`` -> ``every``, ``trainer.val_before_train`` -> ``before_train``,
``actor_rollout_ref.rollout.val_kwargs.{n, do_sample, temperature, top_p}`` -> the same names
here. Defaults are verl's: greedy, one response per prompt, the bootstrap seeded 42.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.errors import ConfigError


@dataclass
class EvalConfig:
    """Which versions are evaluated, on what, and how the responses are sampled."""

    # The validation set, read as the feed reads its dataset (a file, gsm8k:test, a generated
    # task such as digits@1). Empty: no eval stage (streamrl run starts one when it is set)
    dataset: str = ""
    more_datasets: list[str] = field(default_factory=list)  # read after dataset, as one (verl's val_files as a list)
    # The rows' data_source (picks the scorer and names the val-core/<data_source>/ figures);
    # empty: feed.data_source's, or each row's own when that is empty too (verl's parquet rows)
    data_source: str = ""
    limit: int = 0  # rows of the validation set used; 0: all
    every: int = 5  # evaluate every N versions (verl's trainer.test_freq); 0: only before_train and the last
    before_train: bool = True  # evaluate version 0, the policy before any update (verl's val_before_train)
    n: int = 1  # responses per prompt (val_kwargs.n): mean@n, and best@k / worst@k / maj@k when > 1
    do_sample: bool = False  # sample (at temperature, top_p) or decode greedily (val_kwargs.do_sample)
    temperature: float = 0.0  # val_kwargs.temperature (used when do_sample)
    top_p: float = 1.0  # val_kwargs.top_p (used when do_sample)
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    seed: int = 42  # the generation's seed (set before each version) and the bootstrap's (verl's 42)
    # A version that a newer asked version overtook before its evaluation began: skipped (true),
    # or evaluated late (false: every asked version gets its figure, however far behind)
    skip_stale: bool = False
    group: str = ""  # the consumer group on the policy topic; empty: <prefix>-eval
    # Inference servers of the eval stage's own (rollout.backend openai): it loads each asked
    # version into them. Never the training fleet's (that would roll its weights back)
    servers: list[str] = field(default_factory=list)
    # streamrl run: after the learner has stopped, how long the eval stage may take to finish
    # the last version's evaluation before it is stopped
    end_timeout_s: float = 600.0

    @property
    def enabled(self) -> bool:
        return bool(self.dataset)

    def asks(self, version: int, final: bool) -> bool:
        """Whether version ``version`` is evaluated: 0 with ``before_train``, every ``every``-th,
        and the run's last one."""
        if final:
            return True
        if version == 0:
            return self.before_train
        return self.every > 0 and version % self.every == 0

    def validate(self) -> "EvalConfig":
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"config field 'eval.{name}': {why} (got {getattr(self, name)!r})")

        for name in ("limit", "every", "max_new_tokens"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if self.n < 1:
            bad("n", "must be >= 1")
        if self.do_sample and self.temperature <= 0:
            bad("temperature", "do_sample needs a temperature > 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.end_timeout_s <= 0:
            bad("end_timeout_s", "must be > 0")
        return self
