"""Options and argument checks."""
