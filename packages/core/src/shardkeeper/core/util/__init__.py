"""Small torch-free helpers: sizes, progress bars, extras, the package version."""

__all__: list[str] = []
