"""The on-storage format, hostile input included."""
