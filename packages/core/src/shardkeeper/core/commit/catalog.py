"""An optional catalog of committed checkpoints in etcd: fast "what is the newest step of run
X" for schedulers and dashboards, updated transactionally.

The manifest stays the source of truth: the catalog is written after the commit (a failure
there, whatever it is, is logged and counted in ``checkpoint_after_commit_errors_total``, never
fails the save) and may lag or be lost; readers that need certainty list the root. Torch-free,
no client library: etcd's v3 JSON gateway over HTTP (commit/catalog_http.py). Every call has one
deadline, ``timeout_s``, for all of it (connect to last byte), and its answer at most
``MAX_ANSWER_BYTES``; the update after a commit has one deadline for all its calls, so a slow
or dripping endpoint delays a save by at most ``timeout_s``. Its answers are checked for their
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
import math
import time
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import parse_qsl

from shardkeeper.core import metrics
from shardkeeper.core.commit.catalog_http import post_json
from shardkeeper.core.errors import CatalogError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "shardkeeper/"
#: Seconds one call may take, connect to last byte; also what the update after a commit may
#: take in all (``etcd://host:2379/prefix?timeout=2`` sets another).
DEFAULT_TIMEOUT_S = 5.0
#: Most bytes of one answer. The catalog reads single keys (``latest``: a step number) and
#: the step records in pages of ``STEPS_PAGE`` (a record is a few hundred bytes, about a
#: kilobyte with a long root URL, base64 and etcd's fields included): a real answer stays
#: far below; more is not etcd, and is not read into memory.
MAX_ANSWER_BYTES = 4 << 20
#: Step records per range call of ``steps()`` (etcd's ``limit``; the next page starts past
#: the last key). 500 records of a kilobyte are an eighth of ``MAX_ANSWER_BYTES``.
STEPS_PAGE = 500


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
        self,
        endpoint: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 20,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        #: When set (``time.monotonic()``): no call of this catalog ends later (``bounded``).
        self.until: float | None = None

    def bounded(self) -> EtcdCatalog:
        """This catalog, every later call of it ending within ``timeout_s`` from now: the
        update after a commit, whatever number of calls it makes, delays the save no longer."""
        self.until = time.monotonic() + self.timeout_s
        return self

    # -- transport ---------------------------------------------------------------------------
    def _call(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The one place the catalog talks HTTP: one deadline for the whole call, a capped answer."""
        deadline = time.monotonic() + self.timeout_s
        if self.until is not None:
            if self.until <= time.monotonic():
                raise CatalogError(
                    f"etcd catalog at {self.endpoint}: {path} not sent: past the deadline of this update "
                    f"({self.timeout_s:g} s in all); the checkpoints are unaffected (the manifests are the truth)"
                )
            deadline = min(deadline, self.until)
        answer = post_json(
            self.endpoint,
            f"/v3/{path}",
            json.dumps(body).encode(),
            deadline=deadline,
            max_bytes=MAX_ANSWER_BYTES,
            timeout_s=self.timeout_s,
        )
        try:
            out = json.loads(answer.decode() or "{}")
        except ValueError as e:
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

    def _value(self, path: str, kv: dict[str, Any], field: str = "value") -> str:
        """A key-value's ``value`` (or ``key``), base64 of UTF-8 text."""
        raw = kv.get(field, "")
        try:
            if not isinstance(raw, str):
                raise TypeError
            return base64.b64decode(raw, validate=True).decode()
        except (TypeError, ValueError):
            raise self._shape(path, f"'{field}' as base64 of UTF-8 text", raw) from None

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
        out: dict[int, dict[str, Any]] = {}
        for kv in self._range(start):
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

    def _range(self, start: str) -> list[dict[str, Any]]:
        """Every key-value under the prefix ``start``, read ``STEPS_PAGE`` at a time, each page
        starting past the last key of the one before (keys must grow and keep the prefix, or
        the answer is not etcd's and the listing would not end)."""
        out: list[dict[str, Any]] = []
        key = start
        while True:
            body = {"key": _b64(key), "range_end": _prefix_end(start), "limit": STEPS_PAGE}
            answer = self._call("kv/range", body)
            kvs = self._kvs("kv/range", answer)
            out += kvs
            more = answer.get("more", False)  # etcd leaves a false one out
            if not isinstance(more, bool):
                raise self._shape("kv/range", "'more' as a boolean", more)
            if not more or not kvs:
                return out
            last = self._value("kv/range", kvs[-1], "key")
            if not (last.startswith(start) and last >= key):
                raise self._shape("kv/range", f"keys under {start!r} after {key!r}", last)
            key = last + "\0"  # the next key in etcd's (byte) order

    def forget(self, root: str, step: int) -> None:
        """Drop a deleted step's record (retention); ``latest`` is left alone."""
        self._call("kv/deleterange", {"key": _b64(self._key(root, f"steps/{step:012d}"))})


def open_catalog(url: str | None, **options: Any) -> EtcdCatalog | None:
    """``etcd://host:2379[/prefix][?timeout=S]`` or ``http(s)://host:2379`` -> a catalog;
    None -> None. ``timeout``: seconds a call, and the update after a commit, may take."""
    if not url:
        return None
    url, _, query = url.partition("?")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "http", "https"):
        raise ValueError(f"catalog={url!r}: give an etcd endpoint, e.g. etcd://127.0.0.1:2379")
    for name, value in parse_qsl(query, keep_blank_values=True):
        try:
            seconds = float(value) if name == "timeout" else math.nan
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"catalog={url}?{query}: {name}={value!r} is not an option of the catalog; the one option is "
                f"timeout=<seconds > 0>, e.g. etcd://127.0.0.1:2379/jobs?timeout=2"
            )
        options.setdefault("timeout_s", seconds)
    host, _, path = rest.partition("/")
    endpoint = f"{'https' if scheme == 'https' else 'http'}://{host}"
    if path:
        options.setdefault("prefix", path.rstrip("/") + "/")
    return EtcdCatalog(endpoint, **options)


def _failed(what: str, step: int) -> None:
    """Count a catalog failure after a commit or deletion (it is logged by the caller)."""
    metrics.record(metrics.AFTER_COMMIT_ERRORS, 1, step=step, what=what)


#: Per (catalog URL, root URL): the step last committed and when the catalog's update after
#: it must end. Retention's deletions after that commit share that deadline (``forget_deleted``),
#: so that all the catalog work after a commit delays the save by one timeout at most.
_AFTER_COMMIT: dict[tuple[str, str], tuple[int, float]] = {}


def record_commit(url: str | None, storage: Any, step: int, manifest: Any) -> None:
    """After a commit (coordinator): record it in the catalog at ``url``, if one is set. Any
    failure is logged and counted, never raised: the manifest is already the truth, and a
    retry of the committed step would be refused."""
    if not url:
        return
    try:
        catalog = open_catalog(url)
        assert catalog is not None
        _AFTER_COMMIT[(url, storage.url)] = (step, cast(float, catalog.bounded().until))
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


def forget_deleted(url: str | None, storage: Any, steps: list[int], *, after_commit: int | None = None) -> None:
    """After retention or ``delete()`` (coordinator): drop the records of deleted ``steps``.
    Any failure is logged and counted, never raised: a stale record is only a hint (restore
    lists the root). ``after_commit``: the step whose save's retention this is; the deletions
    get what is left of that commit's catalog deadline (others a deadline of their own)."""
    if not url or not steps:
        return
    shared = _AFTER_COMMIT.pop((url, storage.url), None) if after_commit is not None else None
    try:
        catalog = open_catalog(url)
        assert catalog is not None
        catalog.bounded()
        if shared is not None and shared[0] == after_commit:
            catalog.until = shared[1]
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
