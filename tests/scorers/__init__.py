"""Tests of streamrl.scorers."""
