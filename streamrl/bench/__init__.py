"""Benchmarks behind `streamrl bench` (one module each)."""
