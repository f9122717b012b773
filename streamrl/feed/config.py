"""The ``feed`` section of the pipeline config (``PipelineConfig.feed``): a plain dataclass that
OmegaConf checks YAML and ``key.path=value`` overrides against at start, naming a bad field;
``validate()`` adds the cross-field rules a type cannot say."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.errors import ConfigError

#: verl's GSM8K prompt (``examples/data_preprocess/gsm8k.py``): the question, a space, then this.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


@dataclass
class FeedConfig:
    """A dataset to publish on the prompts topic: one record per row and epoch."""

    # ``gsm8k`` / ``gsm8k:test`` (Hugging Face openai/gsm8k through ``datasets``), hf:REPO, or a
    # .jsonl[.gz] / .parquet file (streamrl.datasets)
    dataset: str = "gsm8k"
    # more datasets read after ``dataset``, one after the other, as one (verl's data.train_files
    # given as a list); the row index, and so the group ids, run on across them
    more_datasets: list[str] = field(default_factory=list)
    data_source: str = "gsm8k"  # picks the scorer downstream ("": the row's data_source)
    epochs: int = 1  # passes over the dataset (verl's trainer.total_epochs)
    start_epoch: int = 0  # to continue a feed: epochs start_epoch .. start_epoch + epochs - 1
    group_size: int = 4  # samples per prompt, the GRPO group (verl's rollout.n)
    limit: int = 0  # rows per epoch; 0: all
    shuffle: bool = True  # a different, seeded order per epoch (the group ids do not depend on it)
    seed: int = 0  # the per-epoch shuffle
    # How a row becomes a prompt. ``auto``: a row in verl's format (a chat-list ``prompt``,
    # ``data_source``, ``reward_model.ground_truth``, ``extra_info``, as verl's preprocessing
    # writes it) is read as verl reads it, whatever the keys below say; any other row through
    # the keys below. ``verl``: every row must be verl's. ``template``: always the keys below.
    format: str = "auto"
    # The prompt: ``prompt_template`` formatted with the row's fields, sent as one user chat
    # message (``chat``) as verl's preprocessing does, or as a plain string.
    prompt_template: str = "{question} " + GSM8K_INSTRUCTION
    chat: bool = True  # see prompt_template
    # Ground truth: ``gsm8k`` (the number after ``####`` in ``answer_field``, commas removed),
    # ``field`` (``answer_field`` as is), ``verl`` (``reward_model.ground_truth``) or ``none``.
    ground_truth: str = "gsm8k"
    answer_field: str = "answer"  # the row's column that holds the answer (see ground_truth)
    prompt_key: str = "prompt"  # the column of a row in verl's format that holds its chat messages (verl's data.prompt_key)
    # verl's data.image_key / video_key / audio_key: the columns that carry a row's images, videos,
    # audio. The rollout workers read text prompts only, so a row with a value in one of them is
    # refused naming the column; set to the empty string to not look.
    image_key: str = "images"
    video_key: str = "videos"  # verl's data.video_key: a row with videos there is refused, as with images
    audio_key: str = "audios"  # verl's data.audio_key: a row with audio there is refused, as with images
    # The longest prompt in tokens (verl's data.max_prompt_length), counted as verl's dataset
    # counts it: the prompt through the chat template of ``tokenizer``. 0: no limit
    max_prompt_length: int = 0
    # A longer prompt (verl's data.truncation): error (stops the feed, naming the row), left
    # (keep its last max_prompt_length tokens), right (its first), middle (half of each end)
    truncation: str = "error"
    # Drop the rows whose prompt is longer than max_prompt_length instead (verl's
    # data.filter_overlong_prompts), before any is published
    filter_overlong_prompts: bool = False
    # The tokenizer that counts prompt tokens: "tiny" or a Hugging Face directory; "": the
    # rollout policy's (load_config fills it in when max_prompt_length is set)
    tokenizer: str = ""
    # Continue a run (`streamrl run --resume` sets it): skip the prompts whose groups the
    # learner's checkpoint lists as finished and those already on the prompts topic
    resume: bool = False

    def validate(self) -> "FeedConfig":
        if not self.dataset:
            raise ConfigError("config field 'feed.dataset': required (gsm8k, gsm8k:test, hf:REPO, or a "
                              ".jsonl or .parquet file)")
        if self.format not in ("auto", "verl", "template"):
            raise ConfigError(f"config field 'feed.format': {self.format!r} is not auto|verl|template")
        if self.ground_truth not in ("gsm8k", "field", "verl", "none"):
            raise ConfigError(f"config field 'feed.ground_truth': {self.ground_truth!r} is not gsm8k|field|verl|none")
        if self.truncation not in ("error", "left", "right", "middle"):
            raise ConfigError(f"config field 'feed.truncation': {self.truncation!r} is not error|left|right|middle")
        if self.max_prompt_length < 0:
            raise ConfigError(f"config field 'feed.max_prompt_length': must be >= 0 (got {self.max_prompt_length})")
        if self.epochs < 1 or self.group_size < 1 or self.start_epoch < 0 or self.limit < 0:
            raise ConfigError("config field 'feed.epochs' / 'group_size': >= 1 ('start_epoch', 'limit': >= 0)")
        return self
