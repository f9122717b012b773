"""Tests of streamrl.feed."""
