"""Which directory a local tier may be, and which root a manager may write to: a node's
directory is bound to one persistent root, never adopted from a checkpoint root, and never
taken for a root itself.

A local directory holds the tier's own files (``NODE_TOKEN``, ``ROOT_NAME``) and the steps the
tier wrote, laid out as in any root (step directories, ``LATEST``, ``pending.*``). Its steps
are the tier's only when ``ROOT_NAME`` names this persistent root: without it they are some
root's (a plain run's, two arguments swapped), and binding would restore them as this job's
and delete them by ``local_keep``. Roots are compared by their identity (``root_identity``:
the real path on local disk, so through any symlink alike; the URL on an object store).
"""

from __future__ import annotations

from shardkeeper.core.codec.crypto_format import root_identity
from shardkeeper.core.commit.intents import PREFIX as PENDING_PREFIX
from shardkeeper.core.errors import CheckpointError, CommitConflictError
from shardkeeper.core.format.layout import LATEST_NAME, PREEMPTED_NAME, parse_step_dir
from shardkeeper.core.storage.base import Storage

#: The token file at the top of every local directory.
NODE_TOKEN = ".shardkeeper-node"
#: The persistent root a local directory belongs to.
ROOT_NAME = ".shardkeeper-root"
#: Files only a local tier holds.
TIER_FILES = (NODE_TOKEN, ROOT_NAME)


def root_content(names: list[str]) -> list[str]:
    """The names among a directory's top-level ``names`` that make it a checkpoint root:
    step directories, ``LATEST``, ``pending.*`` records, a preemption record."""
    found = []
    for raw in names:
        name = raw.rstrip("/").rsplit("/", 1)[-1]
        if parse_step_dir(name) is not None or name in (LATEST_NAME, PREEMPTED_NAME) or name.startswith(PENDING_PREFIX):
            found.append(name)
    return sorted(found)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def bind_root(storage: Storage, root: str) -> None:
    """Tie the local directory ``storage`` to the persistent root ``root`` (its URL): a
    directory without ``ROOT_NAME`` is bound only when it holds no checkpoint root's content
    (other files, such as ``lost+found``, are not the tier's and stay untouched); one with it
    must name the same root, so a local directory never serves another job's steps."""
    identity = root_identity(root)
    names = storage.list_dir("")
    if ROOT_NAME not in names:
        found = root_content(names)
        if found:
            raise CheckpointError(
                f"the local directory {storage.url} holds {_shown(found)} but no {ROOT_NAME}: it is a checkpoint "
                f"root (another run's steps), not a local tier of {identity!r}; as one, its steps would be restored "
                f"as this job's and deleted by local_keep. Pass an empty local= directory of its own, or move those "
                f"files away (to resume from them, pass {storage.url} as the root)"
            )
        try:
            storage.put_if_absent(ROOT_NAME, identity.encode())
        except CommitConflictError:
            pass  # another rank of this node
    bound = storage.read_bytes(ROOT_NAME).decode("utf-8", "replace")
    if root_identity(bound) != identity:  # (a marker written before identities: a path as given)
        raise CheckpointError(
            f"the local directory {storage.url} holds the local tier of the root {bound!r}, not of {identity!r}: "
            f"its steps are that job's. Use another local= directory for this root, or empty this one"
        )


def refuse_local_tier(storage: Storage) -> None:
    """Refuse ``storage`` as a manager's root when it is a node's local tier directory (it
    holds the tier's own files): its steps are that tier's, which its job's retention and
    uploads manage, and a local tier is bound to a root (``bind_root``), never one itself.
    An object store is not asked: a local tier is a node's disk or RAM (``local_root``), and
    a root's open costs it no request."""
    if storage.capabilities.remote:
        return
    held = [name for name in TIER_FILES if storage.exists(name)]
    if not held:
        return
    of = ""
    if ROOT_NAME in held:
        bound = storage.read_bytes(ROOT_NAME)[:4096].decode("utf-8", "replace").strip()
        of = f" of the root {bound!r}"
    raise CheckpointError(
        f"CheckpointManager(): {storage.url} is a node's local tier directory{of} (it holds {', '.join(held)}), "
        f"not a checkpoint root. Pass the persistent root as the root (and this directory as local=), or "
        f"another directory"
    )


__all__ = ["NODE_TOKEN", "ROOT_NAME", "TIER_FILES", "bind_root", "refuse_local_tier", "root_content"]
