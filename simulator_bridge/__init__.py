"""Placeholder package; filled in by later issues (see ARCHITECTURE.md)."""
