"""Tests of docker/, k8s, Prometheus rules and alerts, the Grafana dashboard."""
