"""An optional catalog of committed checkpoints in etcd: fast "what is the newest step of run
X" for schedulers and dashboards, updated transactionally.

The manifest stays the source of truth: the catalog is written after the commit (a failure
there, whatever it is, is logged and counted in ``checkpoint_after_commit_errors_total``, never
fails the save) and may lag or be lost; readers that need certainty list the root. Torch-free,
no client library: etcd's v3 JSON gateway through ``urllib``. Its answers are checked for their
shape: anything but what etcd answers (a proxy's page, another service, a gateway of another
version) is a :class:`CatalogError` naming the endpoint, the call and what was found.

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

from shardkeeper.core import metrics
from shardkeeper.core.errors import CatalogError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "shardkeeper/"


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _found(value: Any) -> str:
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _as_int(value: Any) -> int | None:
    """An etcd int64 (the gateway writes them as strings of digits, or ints); None otherwise."""
    if type(value) is int:
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


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
                out = json.loads(resp.read().decode() or "{}")
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise CatalogError(
                f"etcd catalog at {self.endpoint}: {path} failed: {e}; the checkpoints "
                f"are unaffected (the manifests are the truth)"
            ) from e
        if not isinstance(out, dict):
            raise self._shape(path, "a JSON object", out)
        return out

    def _shape(self, path: str, wanted: str, found: Any) -> CatalogError:
        return CatalogError(
            f"etcd catalog at {self.endpoint}: {path} answered {_found(found)} where etcd's v3 gateway "
            f"gives {wanted} (not an etcd endpoint, or a proxy in the way?); the checkpoints are "
            f"unaffected (the manifests are the truth)"
        )

    def _kvs(self, path: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``kvs`` of a range answer: a list of objects (absent: none)."""
        kvs = answer.get("kvs")
        if kvs is None:
            return []
        if not isinstance(kvs, list) or not all(isinstance(kv, dict) for kv in kvs):
            raise self._shape(path, "'kvs' as a list of key-value objects", kvs)
        return kvs

    def _value(self, path: str, kv: dict[str, Any]) -> str:
        """A key-value's ``value``, base64 of UTF-8 text."""
        raw = kv.get("value", "")
        try:
            if not isinstance(raw, str):
                raise TypeError
            return base64.b64decode(raw, validate=True).decode()
        except (TypeError, ValueError):
            raise self._shape(path, "'value' as base64 of UTF-8 text", raw) from None

    def _key(self, root: str, rest: str) -> str:
        return f"{self.prefix}{root.rstrip('/')}/{rest}"

    def _get(self, key: str) -> tuple[str | None, int]:
        """(value, mod_revision); (None, 0) when absent."""
        kvs = self._kvs("kv/range", self._call("kv/range", {"key": _b64(key)}))
        if not kvs:
            return None, 0
        rev = _as_int(kvs[0].get("mod_revision", 0))
        if rev is None:
            raise self._shape("kv/range", "'mod_revision' as an integer", kvs[0].get("mod_revision"))
        return self._value("kv/range", kvs[0]), rev

    def _step(self, key: str, value: str) -> int:
        """The step stored in ``latest``."""
        step = _as_int(value)
        if step is None:
            raise CatalogError(
                f"etcd catalog at {self.endpoint}: {key} holds {_found(value)}, not a step; remove the key "
                f"(etcdctl del {key}) and the next commit sets it again"
            )
        return step

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
            newest = None if current is None else self._step(latest_key, current)
            if newest is not None and newest >= step:
                self._call("kv/put", {"key": _b64(step_key), "value": _b64(value)})
                return newest == step
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
            succeeded = res.get("succeeded", False)  # etcd leaves a false one out
            if not isinstance(succeeded, bool):
                raise self._shape("kv/txn", "'succeeded' as a boolean", succeeded)
            if succeeded:
                return True
        raise CatalogError(
            f"etcd catalog at {self.endpoint}: latest of {root} kept changing; gave up after {self.max_retries} tries"
        )

    def latest(self, root: str) -> int | None:
        """The newest step recorded for ``root`` (a hint: list the root for certainty)."""
        key = self._key(root, "latest")
        value, _ = self._get(key)
        return None if value is None else self._step(key, value)

    def steps(self, root: str) -> dict[int, dict[str, Any]]:
        """Every recorded step of ``root`` with its record (a record that is not one is skipped,
        with a warning)."""
        start = self._key(root, "steps/")
        kvs = self._kvs("kv/range", self._call("kv/range", {"key": _b64(start), "range_end": _prefix_end(start)}))
        out: dict[int, dict[str, Any]] = {}
        for kv in kvs:
            try:
                rec = json.loads(self._value("kv/range", kv))
            except (CatalogError, ValueError) as e:
                log.warning("etcd catalog at %s: a record under %s is skipped: %s", self.endpoint, start, e)
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if type(step) is not int:
                log.warning(
                    "etcd catalog at %s: record %s under %s is skipped: no int step", self.endpoint, _found(rec), start
                )
                continue
            out[step] = rec
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


def _failed(what: str, step: int) -> None:
    """Count a catalog failure after a commit or deletion (it is logged by the caller)."""
    metrics.record(metrics.AFTER_COMMIT_ERRORS, 1, step=step, what=what)


def record_commit(url: str | None, storage: Any, step: int, manifest: Any) -> None:
    """After a commit (coordinator): record it in the catalog at ``url``, if one is set. Any
    failure is logged and counted, never raised: the manifest is already the truth, and a
    retry of the committed step would be refused."""
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
    except Exception as e:  # whatever the endpoint answered: never the committed save's failure
        _failed("catalog", step)
        log.warning(
            "step %d committed under %s, but the catalog was not updated: %s: %s",
            step,
            storage.url,
            type(e).__name__,
            e,
        )


def forget_deleted(url: str | None, storage: Any, steps: list[int]) -> None:
    """After retention or ``delete()`` (coordinator): drop the records of deleted ``steps``.
    Any failure is logged and counted, never raised: a stale record is only a hint (restore
    lists the root)."""
    if not url or not steps:
        return
    try:
        catalog = open_catalog(url)
        assert catalog is not None
        for step in steps:
            catalog.forget(storage.url, step)
    except Exception as e:  # whatever the endpoint answered: never the deletion's failure
        _failed("catalog_forget", steps[-1])
        log.warning(
            "steps %s were deleted under %s, but the catalog still lists them: %s: %s",
            steps,
            storage.url,
            type(e).__name__,
            e,
        )


__all__ = ["EtcdCatalog", "forget_deleted", "open_catalog", "record_commit"]
