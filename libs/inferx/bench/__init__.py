"""Benchmarks of scheduling policies: metrics shared by simulator and live runs."""
