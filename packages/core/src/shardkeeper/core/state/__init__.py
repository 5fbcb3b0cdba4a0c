"""The canonical state: user objects as keys and leaves, their chunks and fragments; the one module that uses torch's private APIs (``_torch_compat``) and the one that unpickles, behind the trust gate."""

__all__: list[str] = []
