"""``output_dir/checkpoint-N``: each committed step where the Trainer's tools look for it.

``transformers.trainer_utils.get_last_checkpoint(output_dir)``, and the scripts built on it
(``train(resume_from_checkpoint=get_last_checkpoint(output_dir))``), find the Trainer's
``checkpoint-N`` folders. The process that writes the Trainer's files (``args.should_save``)
keeps one per committed step of the root, with no tensor data in it:

- ``shardkeeper.json``, the pointer (the JSON document of every adapter's pointers,
  ``shardkeeper.core.adapter``): ``format``, ``version``, ``root``, ``step`` and, for a local
  root, ``root_relative`` (from the folder; tried first, so a copied or moved ``output_dir``
  names the root beside it);
- ``trainer_state.json``: the step's ``TrainerState`` as the Trainer writes it (from the
  step's manifest), for the tools that read it.

A folder never names a step that is not committed:

- it appears only after the commit (the save's done-callback), whole: written in a hidden
  folder (``.checkpoint-N.*.tmp``) that is then renamed; a crash in between leaves it missing;
- before a save goes to the core, the folders of the steps retention drops once it commits
  are removed (renamed to a hidden name, then deleted); a step whose folder could not be
  removed is kept by that retention instead;
- ``train()`` reconciles at its start and end: the folders of steps no longer committed
  (deleted outside the Trainer, e.g. ``shardkeeper delete --damaged``) go, and missing ones
  are written (after a crash, or the Trainer's own end-of-training cleanup).

A ``checkpoint-N`` holding files but neither the pointer nor ``trainer_state.json`` (what a
callback's ``on_save`` wrote into it before the commit) gets both beside its files, and then
goes with its step. One with ``trainer_state.json`` and no pointer (the Trainer's own) is
never touched, nor is a pointer that names another root, unless this root commits the same
step. Failures are logged, never raised: the steps are what resumes, the folders are for the
tools.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shardkeeper.core import CheckpointManager, CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.adapter import (
    MAX_POINTER_BYTES,
    POINTER_VERSION,
    PointerDamagedError,
    RetentionPolicy,
    pointer_document,
    pointer_format,
    read_progress,
    write_file,
)
from shardkeeper.transformers.state import FRAMEWORK, trainer_state_of

log = logging.getLogger(__name__)

POINTER_NAME = "shardkeeper.json"
#: ``shardkeeper-transformers-pointer``: the pointer document every adapter's pointers share.
POINTER_FORMAT = pointer_format(FRAMEWORK)
#: ``transformers.trainer.TRAINER_STATE_NAME``
STATE_NAME = "trainer_state.json"
#: The Trainer's folder names (``transformers.trainer_utils._re_checkpoint``).
FOLDER = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.checkpoint-\d+\.[^/]+\.(tmp|gone)$")
_TMP_AGE_S = 3600.0  # a hidden folder still being written is younger


def folder_name(step: int) -> str:
    return f"checkpoint-{step}"


def same_root(a: str, b: str) -> bool:
    return _norm(a) == _norm(b)


def _norm(root: str) -> str:
    return root.rstrip("/") if "://" in root else os.path.normpath(os.path.abspath(root))


@dataclass(frozen=True)
class Pointer:
    """A folder's pointer: ``root`` is where the root is found (beside the folder, through
    ``root_relative``, else as named), ``named`` the root it names."""

    folder: str
    root: str
    named: str
    step: int


def read_pointer(folder: str, rank: int | None = None) -> Pointer | None:
    """The pointer of ``folder``, or None when it holds none (the Trainer's own folder). A
    damaged one raises ``CorruptCheckpointError``, one of a newer format
    ``IncompatibleFormatError``, each naming the folder, ``rank`` (when given) and the remedy."""
    path = os.path.join(folder, POINTER_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read(MAX_POINTER_BYTES + 1)
    remedy = (
        f"It holds no tensors{'' if rank is None else f' (rank {rank})'}: remove {folder} (train() writes it "
        f"again if its step is committed) and pass resume_from_checkpoint=True, or the root itself"
    )
    try:
        doc = pointer_document(data)
    except PointerDamagedError as e:
        raise CorruptCheckpointError(f"shardkeeper.transformers: {path} is damaged: {e}. {remedy}") from None
    if doc.get("format") != POINTER_FORMAT:
        raise CorruptCheckpointError(f"shardkeeper.transformers: {path} is not a {POINTER_FORMAT} document. {remedy}")
    version, root, step, rel = (doc.get(k) for k in ("version", "root", "step", "root_relative"))
    if type(version) is int and version > POINTER_VERSION:
        raise IncompatibleFormatError(
            f"shardkeeper.transformers: {path} has version {version}, written by a newer shardkeeper "
            f"(this one reads {POINTER_VERSION}): upgrade shardkeeper-transformers. {remedy}"
        )
    if version != POINTER_VERSION or not isinstance(root, str) or not root or type(step) is not int or step < 0:
        raise CorruptCheckpointError(
            f"shardkeeper.transformers: {path} is damaged: it needs version {POINTER_VERSION}, a root and a step "
            f">= 0, found {version!r}, {root!r}, {step!r}. {remedy}"
        )
    beside = os.path.normpath(os.path.join(folder, rel)) if isinstance(rel, str) and rel else None
    found = beside if beside is not None and os.path.isdir(beside) else root
    return Pointer(folder, found, root, step)


class Folders:
    """The ``checkpoint-N`` folders of one Trainer's ``output_dir`` for the steps of ``root``.
    ``writer``: whether this process keeps them (``args.should_save``); elsewhere every method
    does nothing."""

    def __init__(self, output_dir: str, root: str, *, writer: bool) -> None:
        self.writer = writer
        self.dir = os.path.abspath(output_dir)
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self._lock = threading.RLock()  # the save's done-callback runs in the core's thread
        self._doomed: set[int] = set()  # steps a save in flight lets retention drop: no folder

    def path(self, step: int) -> str:
        return os.path.join(self.dir, folder_name(step))

    def before_save(self, mgr: CheckpointManager, step: int, last: Any) -> None:
        """Remove the folders of the steps ``mgr.retention`` drops once ``step`` commits (as the
        core's retention counts: the committed steps, ``last``'s if that save is in flight, and
        ``step``; the newest kept). A step whose folder could not be removed is added to the
        retention's ``keep_steps``: kept rather than left with a folder."""
        if not self.writer:
            return
        kept = self._doomed_folders(mgr, step, [last.step] if last is not None and not last.done() else [])
        if kept:
            mgr.retention = dataclasses.replace(mgr.retention, keep_steps=mgr.retention.keep_steps | kept)

    def _doomed_folders(self, mgr: CheckpointManager, step: int, in_flight: list[int]) -> frozenset[int]:
        """Remove those folders (``before_save``); the steps of those that stay."""
        policy: RetentionPolicy = mgr.retention
        if policy.keeps_all:
            return frozenset()
        with self._lock:
            try:
                have = self._listed()
            except OSError as e:  # (this process alone: never raised into the collective save)
                log.warning(
                    "shardkeeper: %s: the checkpoint-N folders in %s are not updated before this save", e, self.dir
                )
                return frozenset()
            try:
                steps = {*mgr.steps(), *in_flight, step}
            except Exception as e:  # noqa: BLE001 - the folders are for tools: logged, never fatal
                log.warning("shardkeeper: %s: retention keeps the steps of the folders in %s this time", e, self.dir)
                return frozenset(have)
            doomed = steps - policy.retained(steps) - {max(steps)}
            self._doomed |= doomed
            kept = set()
            for s in sorted(doomed & set(have)):
                try:
                    self._retire(have[s])
                except OSError as e:
                    log.warning("shardkeeper: %s was not removed (%s): retention keeps step %d", have[s], e, s)
                    kept.add(s)
            return frozenset(kept)

    def watch(self, mgr: CheckpointManager, handle: Any) -> None:
        """Write the folder of ``handle``'s step once it commits (at once if it has)."""

        def ended(step: int, error: BaseException | None) -> None:
            if error is None:
                self._write_logged(mgr, step)

        if self.writer:
            handle.add_done_callback(ended)

    def sync(self, mgr: CheckpointManager) -> None:
        """Every committed step of the root gets its folder, and the folders of this root's
        steps that are not committed go (no save in flight)."""
        if not self.writer:
            return
        with self._lock:
            self._doomed.clear()
            try:
                committed = set(mgr.steps())
                for s, path in sorted(self._listed().items()):
                    if s not in committed:
                        log.info(
                            "shardkeeper: step %d is no longer committed under %s: removing %s", s, self.root, path
                        )
                        self._retire(path)
                self._clean()
            except Exception as e:  # noqa: BLE001 - logged: the folders are for tools
                log.warning("shardkeeper: the checkpoint-N folders in %s were not reconciled: %s", self.dir, e)
                return
            for s in sorted(committed):
                self._write_logged(mgr, s)

    def _write_logged(self, mgr: CheckpointManager, step: int) -> None:
        try:
            self.write(mgr, step)
        except Exception as e:  # noqa: BLE001 - the step is committed; its folder comes at the next train()
            log.warning(
                "shardkeeper: the folder %s of committed step %d was not written (%s: %s); the next train() writes it",
                self.path(step),
                step,
                type(e).__name__,
                e,
            )

    def write(self, mgr: CheckpointManager, step: int) -> None:
        """Write ``checkpoint-<step>`` for committed ``step`` (nothing when it is there already,
        when it is the Trainer's own, or when a save in flight lets retention drop ``step``)."""
        with self._lock:
            final = self.path(step)
            found = self._found(final, step) if os.path.lexists(final) else "replace"
            if step in self._doomed or found == "keep":
                return
            state = _trainer_state(mgr, step)  # (raises unless the step is committed)
            if found == "adopt":
                self._adopt(final, step, state)
                return
            os.makedirs(self.dir, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{folder_name(step)}.", suffix=".tmp", dir=self.dir)
            try:
                os.chmod(tmp, 0o755)
                state.save_to_json(os.path.join(tmp, STATE_NAME))  # the Trainer's writer, in a folder of ours
                with open(os.path.join(tmp, STATE_NAME), "rb+") as f:
                    os.fsync(f.fileno())
                write_file(os.path.join(tmp, POINTER_NAME), self._pointer(step))  # (fsyncs the folder too)
                if os.path.lexists(final):
                    self._retire(final)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def _found(self, final: str, step: int) -> str:
        """What to do with the entry at ``final`` for ``step``'s folder: ``"replace"`` it (a
        damaged pointer, another step's or root's, an empty folder), ``"adopt"`` it (files
        without a pointer or a ``trainer_state.json``: what a callback's ``on_save`` wrote there
        before the commit) or ``"keep"`` it (this step's pointer; the Trainer's own folder)."""
        if os.path.islink(final) or not os.path.isdir(final):
            log.warning("shardkeeper: %s is not a folder: left as it is, so step %d has no folder", final, step)
            return "keep"
        try:
            p = read_pointer(final)
        except (CorruptCheckpointError, IncompatibleFormatError):
            return "replace"
        if p is None:
            if os.path.lexists(os.path.join(final, STATE_NAME)):
                log.warning(
                    "shardkeeper: %s is the Trainer's own folder: left as it is, so committed step %d of %s has no "
                    "folder (resume it with resume_from_checkpoint=%d)",
                    final,
                    step,
                    self.root,
                    step,
                )
                return "keep"
            return "adopt" if os.listdir(final) else "replace"
        return "keep" if p.step == step and same_root(p.root, self.root) else "replace"

    def _adopt(self, final: str, step: int, state: Any) -> None:
        """Add ``trainer_state.json`` and then the pointer to ``final``, keeping its files; the
        folder names ``step`` (and goes with it) once the pointer is in."""
        fd, tmp = tempfile.mkstemp(prefix=f".{STATE_NAME}.", suffix=".tmp", dir=final)
        os.close(fd)
        try:
            state.save_to_json(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, os.path.join(final, STATE_NAME))
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        write_file(os.path.join(final, POINTER_NAME), self._pointer(step))  # (fsyncs the folder too)

    def _pointer(self, step: int) -> bytes:
        doc: dict[str, Any] = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": self.root, "step": step}
        if "://" not in self.root:
            doc["root_relative"] = os.path.relpath(self.root, self.path(step)).replace(os.sep, "/")
        doc["about"] = (
            f"Step {step} of the shardkeeper root above holds this checkpoint's tensors; this folder holds none. "
            f"Resume: ShardkeeperTrainer(...).train(resume_from_checkpoint=<this folder>). A from_pretrained "
            f"folder: shardkeeper.transformers.export_pretrained(root, to, config=..., step={step})"
        )
        return (json.dumps(doc, indent=1) + "\n").encode()

    def _listed(self) -> dict[int, str]:
        """This root's folders by step (a damaged pointer's by its folder's name)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return {}
        out = {}
        for name in names:
            m, path = FOLDER.match(name), os.path.join(self.dir, name)
            if m is None or os.path.islink(path) or not os.path.isdir(path):
                continue
            try:
                p = read_pointer(path)
            except CorruptCheckpointError:
                out[int(m.group(1))] = path
                continue
            except (IncompatibleFormatError, OSError):
                continue
            if p is not None and same_root(p.root, self.root):
                out[int(m.group(1))] = path  # (a pointer of another step: replaced or removed)
        return out

    def _retire(self, path: str) -> None:
        """Remove a folder without ever leaving part of it under its name: renamed, then deleted."""
        gone = os.path.join(self.dir, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.gone")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        fd = os.open(self.dir, os.O_RDONLY)
        try:  # the removal is on disk before the step it named can go
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)

    def _clean(self) -> None:
        """Remove what a crash left of a write or a removal (a write's only once it is old)."""
        now = time.time()
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else []:
            m, path = _LEFTOVER.match(name), os.path.join(self.dir, name)
            if m is not None and (m.group(1) == "gone" or now - os.lstat(path).st_mtime > _TMP_AGE_S):
                shutil.rmtree(path, ignore_errors=True)


def _trainer_state(mgr: CheckpointManager, step: int) -> Any:
    """The ``TrainerState`` of committed ``step``, from its manifest."""
    from transformers import TrainerState

    fields = {f.name for f in dataclasses.fields(TrainerState)}
    saved = trainer_state_of(read_progress(mgr.manifest(step)))
    return TrainerState(**{k: v for k, v in saved.items() if k in fields})


__all__ = ["FOLDER", "POINTER_NAME", "Folders", "Pointer", "folder_name", "read_pointer", "same_root"]
