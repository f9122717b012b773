"""Benchmarks behind `streamrl bench` (one module each, declared on `harness`)."""
