"""Tests of streamrl.tracking."""
