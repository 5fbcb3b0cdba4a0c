"""``python -m shardkeeper.core.cli``: the ``shardkeeper`` command."""

import sys

from shardkeeper.core.cli import main

__all__: list[str] = []

sys.exit(main())
