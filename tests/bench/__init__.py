"""Tests of streamrl.bench."""
