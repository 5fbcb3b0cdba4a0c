"""A torchrun worker that hangs in a named function, to test the launcher's timeout cleanup."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def stuck_in_a_collective_forever() -> None:
    while True:
        time.sleep(0.5)


if __name__ == "__main__":
    Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    stuck_in_a_collective_forever()
