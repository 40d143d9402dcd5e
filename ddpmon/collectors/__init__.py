"""Samplers of GPU (NVML) and host (psutil) metrics, read off the hot path."""
