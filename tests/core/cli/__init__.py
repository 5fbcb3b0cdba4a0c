"""The ``shardkeeper`` command."""
