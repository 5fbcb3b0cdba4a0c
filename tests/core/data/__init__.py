"""The data position."""
