"""The manager as a training loop uses it."""
