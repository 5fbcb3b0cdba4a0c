"""The manager's knobs: typed, validated options, read from code, the environment or a file (torch-free at import)."""

__all__: list[str] = []
