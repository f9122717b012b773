"""Tests of streamrl.sandbox: the isolated executor, the `streamrl sandbox` service, code rewards."""
