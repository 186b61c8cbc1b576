"""Benchmarks of distlock beside reference lock designs (see run.py)."""
