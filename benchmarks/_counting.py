"""A c10d store wrapper that counts each call (one request to a TCPStore's server) and the
bytes that cross it: what the benchmarks report as store round trips and store bytes."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any


class CountingStore:
    """A c10d store that counts its calls (each one request to a TCPStore's server) and bytes."""

    def __init__(self, store: Any) -> None:
        self._s = store
        self.calls: Counter[str] = Counter()
        self.sent = 0
        self.received = 0
        self.report_bytes: list[int] = []

    def set(self, k: str, v: str | bytes) -> None:
        self.calls["set"] += 1
        self.sent += len(v.encode() if isinstance(v, str) else v)
        self._s.set(k, v)

    def get(self, k: str) -> bytes:
        self.calls["get"] += 1
        v = self._s.get(k)
        self.received += len(v)
        if "/report/" in k:
            self.report_bytes.append(len(v))
        return v  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        self.calls["check"] += 1
        return self._s.check(keys)  # type: ignore[no-any-return]

    def delete_key(self, k: str) -> bool:
        self.calls["delete_key"] += 1
        return self._s.delete_key(k)  # type: ignore[no-any-return]

    def add(self, k: str, n: int) -> int:
        self.calls["add"] += 1
        return self._s.add(k, n)  # type: ignore[no-any-return]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.calls["wait"] += 1
        self._s.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls["multi_get"] += 1
        values = [bytes(v) for v in self._s.multi_get(keys)]
        self.received += sum(map(len, values))
        self.report_bytes.extend(len(v) for k, v in zip(keys, values) if "/report/" in k)
        return values

    def __getattr__(self, name: str) -> Any:
        """Any other store call, counted by name."""
        attr = getattr(self._s, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call
