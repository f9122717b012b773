"""Tests of streamrl.tasks."""
