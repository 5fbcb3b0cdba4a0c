"""``python -m shardkeeper.core.cli``: the ``shardkeeper`` command."""

import sys

from shardkeeper.core.cli import main

sys.exit(main())
