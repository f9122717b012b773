"""Tests of the top-level modules (records, runtime, config, weights, testing)."""
