"""The adapter contract the core owns."""
