"""Prometheus metrics: the catalog of names and the metric families built from samples
(the HTTP server that serves them is ``ddpmon/httpd.py``)."""
