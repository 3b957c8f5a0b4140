"""Simulated GPU engines, agent-chain workloads and virtual-time replay (SIMULATED)."""
