"""An optional catalog of committed checkpoints in etcd: fast "what is the newest step of run
X" for schedulers and dashboards, updated transactionally.

The manifest stays the source of truth: the catalog is written after the commit (a failure
there is logged, never fails the save) and may lag or be lost; readers that need certainty
list the root. Torch-free, no client library: etcd's v3 JSON gateway through ``urllib``.

Layout under ``prefix`` (default ``shardkeeper/``), per root URL ``R``:

- ``<prefix><R>/steps/<step, 12 digits>``: ``{"step", "created_at", "manifest", "size_bytes",
  "world_size"}`` as JSON, one per committed step;
- ``<prefix><R>/latest``: the highest committed step, moved only forward, by compare-and-swap
  on the key's ``mod_revision`` (a racing writer of a lower step never moves it back).
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from shardkeeper.core.errors import CatalogError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "shardkeeper/"


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


def _prefix_end(key: str) -> str:
    """etcd's range_end for "every key with this prefix"."""
    b = bytearray(key.encode())
    b[-1] += 1
    return base64.b64encode(bytes(b)).decode()


class EtcdCatalog:
    """A catalog in etcd at ``endpoint`` (``http://host:2379``), through its v3 JSON gateway."""

    def __init__(
        self, endpoint: str, *, prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0, max_retries: int = 20
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    # -- transport ---------------------------------------------------------------------------
    def _call(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.endpoint}/v3/{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out: dict[str, Any] = json.loads(resp.read().decode() or "{}")
                return out
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise CatalogError(
                f"etcd catalog at {self.endpoint}: {path} failed: {e}; the checkpoints "
                f"are unaffected (the manifests are the truth)"
            ) from e

    def _key(self, root: str, rest: str) -> str:
        return f"{self.prefix}{root.rstrip('/')}/{rest}"

    def _get(self, key: str) -> tuple[str | None, int]:
        """(value, mod_revision); (None, 0) when absent."""
        kvs = self._call("kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None, 0
        return _unb64(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0))

    # -- API ---------------------------------------------------------------------------------
    def record(self, root: str, step: int, info: Mapping[str, Any] | None = None) -> bool:
        """Record committed ``step`` of ``root``; move ``latest`` to it if it is higher, by
        compare-and-swap. Returns True if ``latest`` now is ``step``."""
        step_key = self._key(root, f"steps/{step:012d}")
        latest_key = self._key(root, "latest")
        value = json.dumps({"step": step, **dict(info or {})}, separators=(",", ":"))
        put_step = {"request_put": {"key": _b64(step_key), "value": _b64(value)}}
        for _ in range(self.max_retries):
            current, rev = self._get(latest_key)
            if current is not None and int(current) >= step:
                self._call("kv/put", {"key": _b64(step_key), "value": _b64(value)})
                return int(current) == step
            # absent: its create_revision is 0; present: nobody changed it since we read it
            compare = (
                {"key": _b64(latest_key), "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
                if current is None
                else {"key": _b64(latest_key), "target": "MOD", "mod_revision": str(rev), "result": "EQUAL"}
            )
            res = self._call(
                "kv/txn",
                {
                    "compare": [compare],
                    "success": [put_step, {"request_put": {"key": _b64(latest_key), "value": _b64(str(step))}}],
                },
            )
            if res.get("succeeded"):
                return True
        raise CatalogError(
            f"etcd catalog at {self.endpoint}: latest of {root} kept changing; gave up after {self.max_retries} tries"
        )

    def latest(self, root: str) -> int | None:
        """The newest step recorded for ``root`` (a hint: list the root for certainty)."""
        value, _ = self._get(self._key(root, "latest"))
        return None if value is None else int(value)

    def steps(self, root: str) -> dict[int, dict[str, Any]]:
        """Every recorded step of ``root`` with its record."""
        start = self._key(root, "steps/")
        kvs = self._call("kv/range", {"key": _b64(start), "range_end": _prefix_end(start)}).get("kvs") or []
        out: dict[int, dict[str, Any]] = {}
        for kv in kvs:
            rec = json.loads(_unb64(kv.get("value", "")))
            out[int(rec["step"])] = rec
        return dict(sorted(out.items()))

    def forget(self, root: str, step: int) -> None:
        """Drop a deleted step's record (retention); ``latest`` is left alone."""
        self._call("kv/deleterange", {"key": _b64(self._key(root, f"steps/{step:012d}"))})


def open_catalog(url: str | None, **options: Any) -> EtcdCatalog | None:
    """``etcd://host:2379[/prefix]`` or ``http(s)://host:2379`` -> a catalog; None -> None."""
    if not url:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "http", "https"):
        raise ValueError(f"catalog={url!r}: give an etcd endpoint, e.g. etcd://127.0.0.1:2379")
    host, _, path = rest.partition("/")
    endpoint = f"{'https' if scheme == 'https' else 'http'}://{host}"
    if path:
        options.setdefault("prefix", path.rstrip("/") + "/")
    return EtcdCatalog(endpoint, **options)


def record_commit(url: str | None, storage: Any, step: int, manifest: Any) -> None:
    """After a commit (coordinator): record it in the catalog at ``url``, if one is set. A
    failure is logged, never raised: the manifest is already the truth."""
    if not url:
        return
    try:
        catalog = open_catalog(url)
        assert catalog is not None
        catalog.record(
            storage.url,
            step,
            {
                "created_at": manifest.created_at,
                "world_size": manifest.world_size,
                "manifest": storage.describe(f"step-{step:012d}/manifest.json"),
                "size_bytes": manifest.stored()[1],
            },
        )
    except (CatalogError, ValueError) as e:
        log.warning("step %d committed under %s, but the catalog was not updated: %s", step, storage.url, e)


def forget_deleted(url: str | None, storage: Any, steps: list[int]) -> None:
    """After retention or ``delete()`` (coordinator): drop the records of deleted ``steps``.
    A failure is logged, never raised: a stale record is only a hint (restore lists the root)."""
    if not url or not steps:
        return
    try:
        catalog = open_catalog(url)
        assert catalog is not None
        for step in steps:
            catalog.forget(storage.url, step)
    except (CatalogError, ValueError) as e:
        log.warning("steps %s were deleted under %s, but the catalog still lists them: %s", steps, storage.url, e)


__all__ = ["EtcdCatalog", "forget_deleted", "open_catalog", "record_commit"]
