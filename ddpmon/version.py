"""ddpmon's version: a leaf, so that the rank's records and exporter can carry it without
importing the package's face."""

__version__ = "0.2.0"
