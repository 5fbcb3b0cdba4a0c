"""Chunk encodings, encryption and incremental saves."""
