"""Incomplete S3 multipart uploads under a root's step directories: listing and aborting them (for gc)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.format.layout import parse_step_dir
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


def list_incomplete_uploads(storage: Storage) -> list[dict[str, Any]]:
    """Incomplete S3 multipart uploads of files under the root's step directories.

    Each: ``{"path", "key", "upload_id", "initiated"}`` (path relative to the root, initiated
    in seconds since the epoch). Empty on other backends: a GCS resumable session or a local
    temporary file is not listed this way (local leftovers are files gc already sees).
    """
    fs = getattr(storage, "fs", None)
    root = getattr(storage, "root", None)
    protocol = getattr(storage, "protocol", None)
    if fs is None or not isinstance(root, str) or protocol not in ("s3", "s3a"):
        return []
    bucket, _, prefix = root.partition("/")
    prefix = f"{prefix}/" if prefix else ""
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        for u in page.get("Uploads") or []:
            rel = str(u["Key"])[len(prefix) :]
            if parse_step_dir(rel.split("/", 1)[0]) is None:
                continue  # only what the format writes is ours to judge
            initiated = u.get("Initiated")
            out.append(
                {
                    "path": rel,
                    "key": u["Key"],
                    "upload_id": u["UploadId"],
                    "initiated": initiated.timestamp() if hasattr(initiated, "timestamp") else None,
                }
            )
        if not page.get("IsTruncated"):
            return out
        kwargs["KeyMarker"] = page.get("NextKeyMarker")
        kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")


@dataclass
class UploadsSwept:
    """What ``abort_incomplete_uploads`` aborted (or, in a dry run, would), left alone as too
    young, and could not do."""

    aborted: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def abort_incomplete_uploads(
    storage: Storage, referenced: set[str], min_age_s: float, now: float, dry_run: bool
) -> UploadsSwept:
    """Abort incomplete multipart uploads initiated at least ``min_age_s`` ago (the same age
    rule as files: older than the longest save, so no running save owns them)."""
    swept = UploadsSwept()
    try:
        uploads = list_incomplete_uploads(storage)
    except Exception as e:  # noqa: BLE001 - e.g. a store without the API: report, go on
        swept.errors.append(f"could not list incomplete multipart uploads under {storage.url}: {e}")
        return swept
    fs = getattr(storage, "fs", None)
    bucket = str(getattr(storage, "root", "")).split("/", 1)[0]
    for u in uploads:
        if u["path"] in referenced:
            continue
        if u["initiated"] is not None and now - u["initiated"] < min_age_s:
            swept.young.append(f"{u['path']} (multipart upload {u['upload_id']})")
            continue
        if not dry_run and fs is not None:
            try:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["key"], UploadId=u["upload_id"])
            except Exception as e:  # noqa: BLE001
                swept.errors.append(f"could not abort the multipart upload of {storage.describe(u['path'])}: {e}")
                continue
        log.info(
            "gc: %s incomplete multipart upload of %s",
            "would abort" if dry_run else "aborted",
            storage.describe(u["path"]),
        )
        swept.aborted.append(u["path"])
    return swept


__all__ = ["UploadsSwept", "abort_incomplete_uploads", "list_incomplete_uploads"]
