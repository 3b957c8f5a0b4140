"""InferX: schedules whole AI-agent chains over inference engines."""

__version__ = "0.1.0"
