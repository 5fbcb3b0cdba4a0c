"""Authenticated manifests of encrypted checkpoints.

Manifests stay readable JSON (names, shapes, sizes and digests are visible) and are
authenticated: :func:`seal_manifest` appends an ``"encryption"`` member whose HMAC-SHA256
(under a random per-manifest key, wrapped by the provider) covers every other byte, the
root it is bound to included; :func:`open_manifest` checks it (``EncryptedStorage.read_bytes``
does, before anything of the step is read).

Layering: apart from the data files' cipher (codec/crypto.py), which calls ``open_manifest``
with its key cache; this module needs the key provider and the block constants only
(codec/keys.py, codec/crypto_format.py), so the manager seals manifests without the cipher.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Callable
from typing import Any

from shardkeeper.core.codec.crypto_format import ALGORITHM, BLOCK, bound_name
from shardkeeper.core.codec.keys import KeyProvider
from shardkeeper.core.errors import CorruptCheckpointError, ForeignManifestError
from shardkeeper.core.format.untrusted import loads_untrusted

_MAC_TAIL = len(b'"}}') + 64  # the manifest ends with "mac":"<64 hex>"}}


def seal_manifest(data: bytes, provider: KeyProvider, root: str) -> bytes:
    """``data`` (a manifest's JSON object) with an ``"encryption"`` member appended last whose
    ``mac`` (HMAC-SHA256 under a fresh key wrapped by ``provider``) covers all other bytes,
    the ``root`` it is bound to included."""
    if not data.endswith(b"}") or data == b"{}":
        raise ValueError("not a manifest object")
    mac_key = os.urandom(32)
    key_id, wrapped = provider.wrap(mac_key)
    section = {
        "algorithm": ALGORITHM,
        "block_bytes": BLOCK,
        "key_id": key_id,
        "wrapped_mac_key": base64.b64encode(wrapped).decode(),
        "root": root,
        "mac": "0" * 64,
    }
    body = data[:-1] + b',"encryption":' + json.dumps(section, separators=(",", ":")).encode() + b"}"
    mac = hmac.new(mac_key, body, hashlib.sha256).hexdigest().encode()
    return body[:-_MAC_TAIL] + mac + body[-3:]


def manifest_section(data: bytes) -> dict[str, Any] | None:
    """The ``encryption`` member of a sealed manifest (unauthenticated), or None if it has
    none; a ``ValueError`` says why a member that is there does not parse."""
    at = data.rfind(b',"encryption":{')
    if at < 0 or not data.endswith(b'"}}'):
        return None
    section = loads_untrusted(data[at + len(b',"encryption":') : -1], max_bytes=len(data))
    if not isinstance(section, dict):
        raise ValueError("is not an object")
    return section


def open_manifest(data: bytes, unwrap: Callable[[str, bytes, str], bytes], binding: str, where: str) -> None:
    """Check a manifest's MAC with the key ``unwrap`` (``EncryptedStorage._unwrap``) gives;
    raise a clear error if it is missing, from another key, or wrong (the manifest was changed
    after it was written), or if the manifest names another root than ``binding``."""
    try:
        section = manifest_section(data)
    except ValueError as e:  # UntrustedJSONError: there, but damaged
        raise CorruptCheckpointError(
            f"manifest {where}: its encryption member {e}, so it cannot be authenticated; the "
            f"manifest is damaged: restore another step"
        ) from None
    if section is None:
        # Damage, not a key problem: "restore the newest" falls back past it to a step that
        # authenticates (a root that was never encrypted fails every step, naming this).
        raise CorruptCheckpointError(
            f"manifest {where} is not encrypted/authenticated, and this manager reads only "
            f"encrypted checkpoints (encryption= is set): it was written without encryption, or "
            f"replaced. Restore another step, or restore it without encryption= if it is yours"
        )
    try:
        key_id, wrapped = str(section["key_id"]), base64.b64decode(section["wrapped_mac_key"])
        mac = str(section["mac"]).encode()
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"manifest {where}: encryption member is damaged ({e}); restore another step"
        ) from None
    key = unwrap(key_id, wrapped, f"manifest {where}")
    body = data[:-_MAC_TAIL] + b"0" * 64 + data[-3:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest().encode(), mac):
        raise CorruptCheckpointError(
            f"manifest {where} fails authentication (HMAC-SHA256 mismatch): it was changed after "
            f"it was written; nothing of it was read. Restore another step and run `shardkeeper verify`"
        )
    root = section.get("root")
    if root is not None and bound_name(str(root)) != binding:
        raise ForeignManifestError(
            f"manifest {where} was written under the root {root!r} and is read as part of "
            f"{binding!r}: a step of another root was put here (restore another step), or this "
            f"root was moved or copied from there (then pass encryption_root={root!r}). A step that "
            f"authenticates is never deleted as damaged; if it is not this root's, remove its directory by hand"
        )


__all__ = ["manifest_section", "open_manifest", "seal_manifest"]
