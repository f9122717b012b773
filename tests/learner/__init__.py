"""Tests of streamrl.learner."""
