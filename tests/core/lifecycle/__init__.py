"""Retention, gc, delete, quarantine."""
