"""Advisor, export, importers, preemption."""
