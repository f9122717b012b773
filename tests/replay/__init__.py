"""Tests of streamrl.replay."""
