"""Tests of streamrl.supervisor."""
