"""The canonical state: user objects as keys and leaves, their chunks and fragments; the one place that unpickles, behind the trust gate."""

__all__: list[str] = []
