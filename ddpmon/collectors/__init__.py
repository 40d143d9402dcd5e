"""Samplers of GPU (NVML) and host (psutil) metrics, read off the hot path; torch-free, for
the ranks (``rank/sources.py``) and the node daemon alike."""

from __future__ import annotations

Sample = tuple[str, dict[str, str], float]
