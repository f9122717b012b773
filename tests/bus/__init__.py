"""Tests of streamrl.bus."""
