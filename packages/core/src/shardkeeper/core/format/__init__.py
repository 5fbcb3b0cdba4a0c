"""The on-storage format: manifest, shard files, digests and naming. Needs no torch."""

__all__: list[str] = []
