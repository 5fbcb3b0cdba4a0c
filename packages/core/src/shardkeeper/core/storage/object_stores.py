"""What S3 and GCS need beyond fsspec's generic interface: which URLs are object stores,
how their errors say "precondition failed" or "conflicting conditional write" (botocore,
aiohttp and gcsfs shapes), whether a GCS bucket is zonal (no conditional writes there), and
how S3-compatible stores built on a file system drop the folders a delete leaves behind.

Layering: below the generic store (storage/fsspec_store.py), which asks these questions;
it imports fsspec only, never a backend library (fsspec loads ``s3fs`` or ``gcsfs``).
"""

from __future__ import annotations

import logging
from typing import Any

import fsspec.asyn

log = logging.getLogger(__name__)

S3_PROTOCOLS = frozenset({"s3", "s3a"})
GCS_PROTOCOLS = frozenset({"gs", "gcs"})
OBJECT_STORE_PROTOCOLS = S3_PROTOCOLS | GCS_PROTOCOLS

# S3 answers 409 ConditionalRequestConflict while another conditional write of the same key is
# in flight; the retry then sees 412 (someone won) or succeeds.
CONFLICT_RETRIES = 5


def error_codes(e: BaseException) -> tuple[set[str], set[int]]:
    """The error codes and HTTP statuses found along ``e``'s chain of causes (botocore style)."""
    codes: set[str] = set()
    statuses: set[int] = set()
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            if err.get("Code"):
                codes.add(str(err["Code"]))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(status, int):
                statuses.add(status)
        for attr in ("status", "code"):  # aiohttp errors (whose .code is deprecated), gcsfs HttpError
            value = getattr(cur, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                statuses.add(value)
                break
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return codes, statuses


def is_precondition_failure(e: BaseException) -> bool:
    codes, statuses = error_codes(e)
    return "PreconditionFailed" in codes or "412" in codes or 412 in statuses


def is_conditional_conflict(e: BaseException) -> bool:
    return "ConditionalRequestConflict" in error_codes(e)[0]


def is_zonal_bucket(fs: Any, bucket: str) -> bool:
    """Whether GCS ``bucket`` is a zonal (Rapid) bucket, where gcsfs writes over gRPC and
    ignores ``mode="create"``; False when gcsfs cannot tell (it then treats it as regular)."""
    try:
        return bool(fsspec.asyn.sync(fs.loop, fs._is_zonal_bucket, bucket))
    except Exception as e:  # unknown: gcsfs itself then treats the bucket as regular
        log.debug("could not tell whether gs://%s is a zonal bucket: %s", bucket, e)
        return False


def bucket_exists(fs: Any, bucket: str) -> bool | None:
    """Whether ``bucket`` exists: False only when the store says it does not; None when the
    question found no answer (no permission to ask, a transient error), so that the caller
    goes on and meets the store's own error on its first real request."""
    try:
        fs.info(bucket)  # (not ``exists``: s3fs answers False to an unreachable endpoint too)
    except FileNotFoundError:
        return False
    except Exception:  # botocore, aiohttp and gcsfs raise their own types
        return None
    return True


def remove_empty_folders(fs: Any, full: str, bucket: str) -> None:
    """Remove ``full`` and the (now empty) folders below it, deepest first.

    S3-compatible stores built on a file system (SeaweedFS) keep a folder when its last
    object is deleted and list it as a common prefix from then on: a deleted step would
    still show up in every listing. Deleting the key ``<folder>/`` removes such a folder
    if it is empty; on AWS S3 that key does not exist and the delete is a no-op. Costs one
    listing per remaining folder (one in all on AWS S3) and one DeleteObjects request.
    """
    folders: list[str] = []

    def walk(folder: str) -> None:
        try:
            entries = fs.ls(folder, detail=True, refresh=True)
        except FileNotFoundError:
            entries = []
        for entry in entries:
            name = entry["name"].rstrip("/")
            if entry.get("type") == "directory" and name != folder:
                walk(name)
        folders.append(folder)

    walk(full)
    keys = [f.split("/", 1)[1] + "/" for f in folders if "/" in f]
    for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
        objects = [{"Key": k} for k in keys[i : i + 1000]]
        fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})


__all__ = [
    "CONFLICT_RETRIES",
    "GCS_PROTOCOLS",
    "OBJECT_STORE_PROTOCOLS",
    "S3_PROTOCOLS",
    "bucket_exists",
    "error_codes",
    "is_conditional_conflict",
    "is_precondition_failure",
    "is_zonal_bucket",
    "log",
    "remove_empty_folders",
]
