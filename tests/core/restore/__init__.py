"""Restores, fallbacks and resharding."""
