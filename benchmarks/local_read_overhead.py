"""Per-call CPU cost of ``LocalStorage`` reads: 10,000 ``read_into`` calls of 4 KiB (at
offsets cycling through a 4 MiB file, warm page cache) and 10,000 ``read_bytes`` of a 1 KiB
file; best of 5, as process CPU time (user + system), which a busy machine disturbs less
than wall time.

    python benchmarks/local_read_overhead.py              # openat2(RESOLVE_BENEATH) where the kernel has it
    python benchmarks/local_read_overhead.py --no-openat2  # the fallback: open + /proc/self/fd check

Restore issues one ``read_into`` per coalesced range, so this is the fixed cost each range
pays for opening, checking (a regular file, inside the root) and closing the file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from shardkeeper.core.storage import LocalStorage

N = 10_000


def best(fn) -> float:  # noqa: ANN001
    out = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        fn()
        out = min(out, time.process_time() - t0)
    return out / N * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-openat2", action="store_true", help="measure the fallback path")
    args = ap.parse_args()
    if args.no_openat2:
        from shardkeeper.core.storage import beneath

        beneath._syscall = None
    with tempfile.TemporaryDirectory() as d:
        storage = LocalStorage(d, fsync=False)
        data = "step-000000000001/data/r00000-aaaaaaaa-000.safetensors"
        w = storage.open_writer(data)
        w.write(os.urandom(4 << 20))
        w.close()
        storage.put_if_absent("step-000000000001/manifest.json", b"x" * 1024)
        buf = memoryview(bytearray(4096))

        def read_into() -> None:
            for i in range(N):
                storage.read_into(data, (i % 1024) * 4096, buf)

        def read_bytes() -> None:
            for _ in range(N):
                storage.read_bytes("step-000000000001/manifest.json")

        read_into()
        print(f"read_into 4 KiB: {best(read_into):.2f} us/call; read_bytes 1 KiB: {best(read_bytes):.2f} us/call")


if __name__ == "__main__":
    main()
