"""What a manager's parts share once a root is open: the context, the rank coordinator over the c10d store, the root's diagnosis."""

__all__: list[str] = []
