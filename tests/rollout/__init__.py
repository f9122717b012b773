"""Tests of streamrl.rollout."""
