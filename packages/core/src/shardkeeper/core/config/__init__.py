"""The manager's knobs: typed, validated options, read from code, the environment or a file (torch-free)."""

__all__: list[str] = []
