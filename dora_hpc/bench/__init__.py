"""Benchmarks behind ``dora-hpc bench``: long-running measurements, never part of the tests."""
