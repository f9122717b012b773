"""Tests of streamrl.evaluation."""
