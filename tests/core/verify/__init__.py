"""Verification of committed steps."""
