"""Tests of streamrl.archive."""
