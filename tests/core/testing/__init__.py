"""The kits shipped for users."""
