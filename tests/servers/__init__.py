"""Tests of streamrl.servers."""
