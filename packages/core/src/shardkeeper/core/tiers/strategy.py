"""How a manager's checkpoints are tiered: the ``TierStrategy`` it holds and calls alike with
one tier or two (docs/tiers.md).

A strategy is the save's hooks (``save/hooks.py``: what runs around each commit, retention
included) and what else differs between one tier and two: which steps are committed and
where one process reads them, restore, ``delete()``, the members the manager shows for the
tiers (``last_restore_tier``, ``persistent_reads``, ``persisted_steps``, ``wait_persisted``,
``upload_newest``) and close. ``OneTier`` is a plain manager's, its root alone; ``TwoTiers``
(``two_tiers.py``) a node-local tier in front of the persistent root. ``TierSettings`` are the
manager's tier keywords, checked; ``open_roots`` and ``make_strategy`` choose between the two, once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from shardkeeper.core.commit.committed import committed_steps, is_committed, newest_committed
from shardkeeper.core.config.arguments import check_count, check_replicas
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.restore.plan import RestoreStats
from shardkeeper.core.restore.request import RestoreRequest
from shardkeeper.core.restore.restorer import Restorer
from shardkeeper.core.runtime.context import Encryption, ManagerContext, open_root
from shardkeeper.core.save.hooks import OneRoot, SaveHooks
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.erasure import Code
from shardkeeper.core.tiers.opening import check_tier_options, open_tiers
from shardkeeper.core.tiers.tiering import Opened, Tiering
from shardkeeper.core.tiers.two_tiers import TwoTiers
from shardkeeper.core.util.ints import integral


class TierStrategy(SaveHooks, Protocol):
    """What the manager asks of its tiers, besides the save's hooks."""

    @property
    def url(self) -> str:
        """The root saves are for, in messages (with two tiers the persistent root)."""
        ...

    @property
    def last_stats(self) -> RestoreStats | None:
        """What the last restore attempt that succeeded on this rank read."""
        ...

    @property
    def last_tier(self) -> str | None:
        """Where the last restore read from (``"local"`` or ``"persistent"``; None: one tier)."""
        ...

    @property
    def persistent_reads(self) -> int:
        """Bytes this rank's restores read from the persistent root (0: one tier)."""
        ...

    def persisted_steps(self) -> list[int]:
        """The steps uploaded and committed to the persistent root so far ([]: one tier)."""
        ...

    def wait_persisted(self) -> None:
        """Block until the running upload ends; raise its failure (nothing with one tier)."""
        ...

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        """Every rank, a preemption's exit: upload the newest step committed locally unless an
        upload has it, waiting up to ``timeout_s``; (that step, whether it is persisted now).
        ``(None, False)`` with one tier."""
        ...

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        ...

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        ...

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed."""
        ...

    def reader(self, step: int | None) -> ManagerContext:
        """Where one process reads ``step`` (None: the newest) from."""
        ...

    def delete(self, step: int, *, damaged: bool) -> bool:
        """Collective: ``CheckpointManager.delete``."""
        ...

    def restore(self, state: Mapping[str, Any], request: RestoreRequest) -> int:
        """Collective: ``CheckpointManager.restore``; the step restored."""
        ...

    def close(self) -> None:
        """Release what the tiers hold (the manager's threads are its own)."""
        ...


class OneTier(OneRoot):
    """A manager without tiers: its root alone (the save's hooks: ``OneRoot``)."""

    last_tier: str | None = None
    persistent_reads = 0

    def __init__(self, ctx: ManagerContext) -> None:
        super().__init__(ctx)
        self.restorer = Restorer(ctx)

    @property
    def url(self) -> str:
        return self.ctx.storage.url

    @property
    def last_stats(self) -> RestoreStats | None:
        return self.restorer.last_stats

    def persisted_steps(self) -> list[int]:
        return []

    def wait_persisted(self) -> None:
        pass

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        return None, False

    def steps(self) -> list[int]:
        return committed_steps(self.ctx.storage)

    def latest(self) -> int | None:
        return newest_committed(self.ctx.storage)

    def is_committed(self, step: int) -> bool:
        return is_committed(self.ctx.storage, step)

    def reader(self, step: int | None) -> ManagerContext:
        return self.ctx

    def delete(self, step: int, *, damaged: bool) -> bool:
        return deletion.delete_step(self.ctx, step, damaged=damaged)

    def restore(self, state: Mapping[str, Any], request: RestoreRequest) -> int:
        return self.restorer.restore_state(state, request, stacklevel=3)  # (the warning names the manager's caller)

    def close(self) -> None:
        pass


def tier_where(root: Any) -> str:
    """``"ROOT, rank N"``, naming who refuses a tier keyword before anything is opened (the
    global rank when torch.distributed is initialised, else 0)."""
    if isinstance(root, Storage):
        name = root.url
    else:
        name = os.fspath(root) if isinstance(root, (str, os.PathLike)) else repr(root)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"{name}, rank {rank}"


def _kind(value: Any) -> str:
    if isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def check_erasure(erasure: Any, replicas: int, where: str = "CheckpointManager()") -> tuple[int, int] | None:
    """``erasure``: None, or a pair (k, m) of ints >= 1 (any two-item sequence: a tuple, a
    list as JSON or YAML configs give it, a numpy array; numpy ints too); never with
    ``replicas``. Refusals start with ``where`` (``tier_where``)."""
    if erasure is None:
        return None
    pair = erasure.tolist() if hasattr(erasure, "tolist") else erasure  # (a numpy array, a tensor)
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise TypeError(
            f"{where}: erasure must be a pair (k, m) of ints (k data nodes per group, m parity nodes; a tuple, or a "
            f"list from a config), got {_kind(erasure)}; pass e.g. erasure=(4, 1), or drop erasure="
        )
    k, m = (integral(v) for v in pair)
    for name, got, raw in (("k", k, pair[0]), ("m", m, pair[1])):
        if got is None:
            raise TypeError(
                f"{where}: erasure=(k, m): {name} must be an int, got {_kind(raw)}; pass e.g. erasure=(4, 1)"
            )
    assert k is not None and m is not None
    try:
        Code(k, m)  # (m >= 2 without zfec: an ImportError naming the extra)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except ImportError as e:
        raise ImportError(f"{where}: {e}") from e
    if replicas:
        raise ValueError(
            f"{where}: replicas={replicas} and erasure={(k, m)} both protect the local tier against a node's loss; "
            f"pass one of them (erasure=(k, m) costs m/k extra memory, replicas=1 a full copy)"
        )
    return k, m


@dataclass(frozen=True)
class TierSettings:
    """The manager's tier keywords, checked: ``local`` (None: one tier), ``persist_every``,
    ``replicas``, ``local_keep`` and ``erasure`` ((k, m) or None; docs/tiers.md)."""

    local: str | os.PathLike[str] | None
    persist_every: int | None
    replicas: int
    local_keep: int | None
    erasure: tuple[int, int] | None = None

    @classmethod
    def checked(
        cls,
        local: Any,
        persist_every: Any,
        replicas: Any,
        local_keep: Any,
        erasure: Any = None,
        where: str = "CheckpointManager()",
    ) -> TierSettings:
        """The counts' types and ranges; the other four only with ``local``. Refusals start
        with ``where`` (``tier_where``: the root and the rank) and end with the remedy."""
        persist_every = check_count(
            "persist_every", persist_every, where, "pass persist_every=N (upload every N steps)"
        )
        local_keep = check_count("local_keep", local_keep, where, "pass local_keep=N (keep N steps per node)")
        replicas = check_replicas(replicas, where, "pass replicas=1 (a copy on another node), or 0 (none)")
        code = check_erasure(erasure, replicas, where)
        if local is None and (persist_every is not None or replicas or local_keep is not None or code):
            raise ValueError(
                f"{where}: persist_every=, replicas=, erasure= and local_keep= configure the local tier; "
                "pass local='/node/local/dir' too (or drop them to save straight to the root)"
            )
        return cls(local, persist_every, replicas, local_keep, code)

    @property
    def tiered(self) -> bool:
        return self.local is not None

    def check_options(self, options: CheckpointOptions) -> CheckpointOptions:
        """``options`` as the tiers allow them (``opening.check_tier_options``)."""
        return options if self.local is None else check_tier_options(options)


@dataclass(frozen=True)
class Roots:
    """The root saves write (``storage``, with its authenticated view ``read`` and its
    ``encryption``), and with two tiers both tiers' (local, persistent)."""

    storage: Storage
    read: Storage
    encryption: Encryption | None
    tiers: tuple[Opened, Opened] | None = None


def open_roots(
    tiers: TierSettings, root: Any, storage_options: Mapping[str, Any] | None, options: CheckpointOptions
) -> Roots:
    """``root`` opened as a plain manager's (``context.open_root``), or with ``tiers.local``
    as both tiers (``opening.open_tiers``), saves writing the node's directory."""
    if tiers.local is None:
        storage, read, keyed = open_root(
            root,
            storage_options,
            retry=options.retry_policy(),
            encryption=options.encryption,
            bound_to=options.encryption_root,
        )
        return Roots(storage, read, keyed)
    local, persistent = open_tiers(root, tiers.local, storage_options, options)
    return Roots(local.storage, local.read, local.encryption, (local, persistent))


def make_strategy(
    tiers: TierSettings, roots: Roots, ctx: ManagerContext, retention: RetentionPolicy
) -> tuple[TierStrategy, Tiering | None]:
    """The strategy over ``roots`` (``ctx``: the manager's, on ``roots.storage``), and the two
    tiers' ``Tiering`` (None with one: ``CheckpointManager.tiering``). With two tiers a
    collective: ``Tiering`` finds the nodes."""
    if roots.tiers is None:
        return OneTier(ctx), None
    local, persistent = roots.tiers
    tiering = Tiering(
        ctx.coord,
        local=local,
        persistent=persistent,
        persist_every=tiers.persist_every,
        replicas=tiers.replicas,
        erasure=tiers.erasure,
        local_keep=tiers.local_keep,
        retention=retention,
        catalog=ctx.settings.catalog,
        io=ctx.io,
        timeout_s=ctx.settings.commit_timeout_s,
    )
    return TwoTiers(ctx, tiering), tiering


__all__ = [
    "check_erasure",
    "tier_where",
    "OneTier",
    "Roots",
    "TierSettings",
    "TierStrategy",
    "make_strategy",
    "open_roots",
]
