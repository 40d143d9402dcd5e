"""Prometheus metrics: the catalog of names and the exporter."""
