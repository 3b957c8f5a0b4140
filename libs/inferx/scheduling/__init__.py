"""Scheduling policy: pure code (no I/O, time passed in), shared by the live scheduler
service and the simulator."""
