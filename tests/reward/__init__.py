"""Tests of streamrl.reward."""
