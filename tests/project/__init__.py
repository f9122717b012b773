"""Tests of the project's own rules: imports and layers, install, docs, contracts, xdist groups."""
