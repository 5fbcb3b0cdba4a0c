"""The canonical state."""
