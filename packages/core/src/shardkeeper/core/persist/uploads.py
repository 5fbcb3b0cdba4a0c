"""The uploads of a manager with a node-local tier and ``writer="process"``, as its trainer
sees them: they run in the persist process (``tiers/process_writer.py``), so the trainer's
``persisted_steps``, ``wait_persisted()``, the waits of ``restore()`` and ``delete()`` and a
preemption's final upload (``upload_newest``) ask it over the channel (an ``uploads``
message; the answer comes after every save handed over before it, which the manager has
waited for already)."""

from __future__ import annotations

import logging
from typing import Any

from shardkeeper.core.errors import CheckpointError, CheckpointSaveError, PersistChannelClosed
from shardkeeper.core.persist.channel import rebuilt
from shardkeeper.core.persist.client import PersistRunner

log = logging.getLogger(__name__)


class RemoteUploads:
    """``Persister``'s ``join``, ``wait`` and ``persisted`` and ``Tiering.upload_newest``,
    answered by ``runner``'s persist process. With no persist process (closed, or none yet
    after one died) nothing runs: the steps last heard of, and no failure (``upload_newest``
    raises)."""

    def __init__(self, runner: PersistRunner) -> None:
        self.runner = runner
        self._steps: list[int] = []

    def _ask(
        self, *, join: bool, take_error: bool, final: float | None = None, forget: tuple[int | None] | None = None
    ) -> dict[str, Any] | None:
        r = self.runner
        if not r.handed_over and forget is None:
            return None  # (none this manager has handed a save: no upload)
        msg: dict[str, Any] = {"join": join, "take_error": take_error, "final": final}
        if forget is not None:
            msg["forget_above"] = forget[0]
        try:
            payload = r.ask("uploads", msg)
        except PersistChannelClosed as e:
            raise CheckpointSaveError(
                f"rank {r.ctx.rank}: its persist process ended ({e}) before it said how its uploads to the "
                f"persistent root went; a step it was uploading may not be persisted (each step stays committed "
                f"in the local tier; the next save starts a new persist process)",
                step=-1,
            ) from e
        if payload is not None:  # (a union: a persist process started after one died knows only its own)
            self._steps = sorted(set(self._steps) | {int(s) for s in payload["steps"]})
        return payload

    @property
    def persisted(self) -> list[int]:
        """The steps the persist process has uploaded and committed (a running upload not yet)."""
        try:
            self._ask(join=False, take_error=False)
        except CheckpointSaveError:
            pass
        return list(self._steps)

    def join(self) -> None:
        """Wait for the running upload, keeping its failure for ``wait``."""
        self._ask(join=True, take_error=False)

    def forget_above(self, newest: int | None) -> None:
        """``Persister.forget_above`` in the persist process (a restore quarantined the
        persistent root's steps above ``newest``), told even before its first save: it may
        have listed the root before the quarantine. One that has ended is not told: the next
        one lists the root afresh."""
        try:
            self._ask(join=False, take_error=False, forget=(newest,))
        except CheckpointError as e:
            log.warning("rank %d: its persist process was not told of the quarantine: %s", self.runner.ctx.rank, e)

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        """``Tiering.upload_newest``, run by the persist process: (the newest step it committed
        locally, whether it is uploaded by now). Raises ``CheckpointSaveError`` when the persist
        process has ended (none uploads that step now)."""
        r = self.runner
        answer = self._ask(join=False, take_error=False, final=timeout_s)
        if answer is None and not r.handed_over:
            return None, False  # (no save handed over: nothing of this manager's to upload)
        if answer is None:
            raise CheckpointSaveError(
                f"rank {r.ctx.rank}: its persist process ended ({r.ended()}) before the final upload to the "
                f"persistent root; the newest step committed in the local tier is not uploaded",
                step=-1,
            )
        final = answer["final"]
        if final["error"] is not None:
            raise rebuilt(final["error"])
        return final["step"], bool(final["done"])

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the running upload; raise an upload failure nobody has seen."""
        answer = self._ask(join=True, take_error=True)
        if answer is not None and answer["error"] is not None and raise_error:
            raise rebuilt(answer["error"])


__all__ = ["RemoteUploads"]
