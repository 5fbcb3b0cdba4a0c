"""Tools to test checkpointing on your own storage: the kill -9 campaign (``campaign``)."""
