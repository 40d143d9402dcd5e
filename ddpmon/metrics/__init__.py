"""Prometheus metrics: the catalog of names, the exposition (families, the HTTP endpoint)."""
