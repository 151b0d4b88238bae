"""Offline commands (python -m engine.tools.<name>)."""
