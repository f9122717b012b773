"""Tests of verl's launch scripts, keys and reward functions, unchanged."""
