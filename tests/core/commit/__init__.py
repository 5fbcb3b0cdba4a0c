"""The commit protocol and its races."""
