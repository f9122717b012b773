"""Tests of streamrl.distillation."""
