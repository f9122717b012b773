"""streamrl: a Kafka streaming pipeline for reinforcement-learning post-training of LMs."""

__version__ = "0.1.0"
