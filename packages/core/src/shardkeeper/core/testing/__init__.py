"""Tools to test checkpointing on your own storage: the kill -9 campaign (``campaign``) and
the storage conformance suite every backend must pass (``storage_conformance``; needs pytest)."""
