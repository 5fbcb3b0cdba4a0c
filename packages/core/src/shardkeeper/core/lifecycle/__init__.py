"""Removing what is no longer needed, never what a commit needs: retention, gc of failed saves, delete, quarantine (torch-free)."""

__all__: list[str] = []
