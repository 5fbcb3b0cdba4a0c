"""Coordination between ranks."""
