"""The kill -9 campaign: kill a writer at random points of a save, then check what survived.

``python -m shardkeeper.core.testing.campaign ROOT --trials 50 --seed 1`` (ROOT: a path or
an ``s3://`` / ``gs://`` URL; ``--storage-options JSON`` for the store) prints a JSON summary.
Each trial forks a writer from this process (torch is imported once), which saves a
deterministic state (a function of the step) for a few successive steps with retention
(``keep_last=2`` unless ``--manager-options`` says otherwise), the way a restarted job
continues from the newest committed step. The
writer dies by SIGKILL at a point the parent drew with a seeded RNG:

=====================  ====================================================================
``staging``            a timer fires while ``save()`` plans and copies the state
``open_writer``        when the Nth data file is created
``mid_write``          inside a data-file write, after N bytes of the file went through
                       (on S3 with a file larger than one part: mid multipart upload)
``close``              when the Nth data file is being completed
``before_manifest``    all data written, the manifest not yet (between data and commit)
``after_manifest``     the manifest written, before the caller heard of it (LATEST, retention)
``retention``          at the Nth delete of retention
``random_time``        the parent kills it after a random delay, wherever it is
=====================  ====================================================================

After each kill the parent checks, on the store: only committed steps are listed and each
verifies clean; the newest committed step is at least the last one the writer saw committed
(nothing acknowledged is lost) and restores bit for bit to its state; ``collect_garbage`` with
``min_age_s=0`` removes every uncommitted leftover and leaves the committed steps intact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.storage.wrapper import StorageWrapper

#: The writers' manager options that ``--manager-options`` may override (and, with ``--local``,
#: the tier's); ``async_save`` is drawn per trial unless given.
_DEFAULTS: dict[str, Any] = {"keep_last": 2}
_TIER_DEFAULTS: dict[str, Any] = {"local_keep": 2, "persist_every": 2}

KILL_POINTS = (
    "staging",
    "open_writer",
    "mid_write",
    "close",
    "before_manifest",
    "after_manifest",
    "retention",
    "random_time",
)


def deterministic_state(step: int, tensor_bytes: int = 1 << 20) -> dict[str, Any]:
    """The state saved at ``step``: a few float32 tensors of about ``tensor_bytes`` in all."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    n = max(1, tensor_bytes // 4)
    sizes = [n // 2, n // 4, n - n // 2 - n // 4]
    return {
        "model": {f"layer{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(sizes)},
        "step": step,
    }


def _blank_like(state: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.new_zeros(v.shape) for k, v in state["model"].items()}, "step": -1}


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingStorage(StorageWrapper):
    """A storage wrapper that SIGKILLs its own process at the ``n``-th call of kill point ``point``."""

    def __init__(self, inner: Any, point: str, n: int, after_bytes: int = 0) -> None:
        super().__init__(inner)
        self.point = point
        self.n = n
        self.after_bytes = after_bytes
        self._count = 0
        self._lock = threading.Lock()

    def _hit(self, point: str) -> bool:
        if point != self.point:
            return False
        with self._lock:
            self._count += 1
            return self._count == self.n

    def open_writer(self, path: str) -> Any:
        if self._hit("open_writer"):
            _kill_self()
        return _KillingWriter(self, path, self.inner.open_writer(path))

    def put_if_absent(self, path: str, data: bytes) -> None:
        manifest = path.endswith("manifest.json")
        if manifest and self._hit("before_manifest"):
            _kill_self()
        self.inner.put_if_absent(path, data)
        if manifest and self._hit("after_manifest"):
            _kill_self()

    def delete(self, path: str) -> None:
        if self._hit("retention"):
            _kill_self()
        self.inner.delete(path)

    def delete_dir(self, path: str) -> None:
        if self._hit("retention"):
            _kill_self()
        self.inner.delete_dir(path)

    # everything else passes through (explicit, so that the Storage protocol is met)
    def list_dir(self, path: str) -> list[str]:
        return list(self.inner.list_dir(path))

    def exists(self, path: str) -> bool:
        return bool(self.inner.exists(path))

    def size(self, path: str) -> int:
        return int(self.inner.size(path))

    def mtime(self, path: str) -> float:
        return float(self.inner.mtime(path))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.inner.read_bytes(path))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return bytes(self.inner.read_range(path, offset, length))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(path, offset, buffer)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def put(self, path: str, data: bytes) -> None:
        self.inner.put(path, data)


class _KillingWriter:
    def __init__(self, owner: KillingStorage, path: str, inner: Any) -> None:
        self._owner = owner
        self._inner = inner
        self._written = 0
        self._armed = owner.point == "mid_write" and owner._hit("mid_write")

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._armed and self._written + len(view) > self._owner.after_bytes:
            room = max(0, self._owner.after_bytes - self._written)
            if room:
                self._inner.write(view[:room])
            _kill_self()
        self._inner.write(view)
        self._written += len(view)

    def close(self) -> None:
        if self._owner._hit("close"):
            _kill_self()
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


@dataclass
class Trial:
    index: int
    point: str
    n: int
    after_bytes: int
    delay_s: float
    first_step: int
    steps: int
    async_save: bool


@dataclass
class Summary:
    root: str
    seed: int
    trials: int = 0
    killed: int = 0
    completed: int = 0
    points: Counter[str] = field(default_factory=Counter)
    points_hit: Counter[str] = field(default_factory=Counter)
    commits_acknowledged: int = 0
    steps_verified: int = 0
    restores_bit_exact: int = 0
    leftovers_removed: int = 0
    incomplete_uploads_aborted: int = 0
    failures: list[str] = field(default_factory=list)  # what was lost or damaged
    writer_errors: list[str] = field(default_factory=list)  # writers that failed, not by the kill
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "seed": self.seed,
            "trials": self.trials,
            "killed": self.killed,
            "completed_without_kill": self.completed,
            "kill_points_drawn": dict(sorted(self.points.items())),
            "kill_points_hit": dict(sorted(self.points_hit.items())),
            "commits_acknowledged": self.commits_acknowledged,
            "steps_verified": self.steps_verified,
            "restores_bit_exact": self.restores_bit_exact,
            "leftovers_removed": self.leftovers_removed,
            "incomplete_uploads_aborted": self.incomplete_uploads_aborted,
            "lost_or_damaged": len(self.failures),
            "failures": self.failures,
            "writer_errors": self.writer_errors,
            "seconds": round(self.seconds, 2),
        }


def _draw(rng: random.Random, index: int, first_step: int, points: Sequence[str], tensor_bytes: int) -> Trial:
    steps = rng.randint(1, 3)
    point = points[index % len(points)] if index < len(points) else rng.choice(points)
    n = rng.randint(1, steps)
    return Trial(
        index=index,
        point=point,
        n=n,
        after_bytes=rng.randint(1, max(1, tensor_bytes)),
        delay_s=rng.uniform(0.0, 1.0),
        first_step=first_step,
        steps=steps,
        async_save=rng.random() < 0.5,
    )


def _writer(
    root: str,
    options: dict[str, Any],
    manager_options: dict[str, Any],
    t: Trial,
    tensor_bytes: int,
    wfd: int,
    local: str | None = None,
) -> None:
    from shardkeeper.core import CheckpointManager
    from shardkeeper.core.storage import open_storage

    own = {**_DEFAULTS, "async_save": t.async_save}  # the campaign's; manager_options override them
    if local is None:
        storage = KillingStorage(open_storage(root, **options), t.point, t.n, t.after_bytes)
        mgr = CheckpointManager(storage, **{**own, **manager_options})  # type: ignore[arg-type]
    else:  # the kills land in the local tier; every other step is uploaded to ``root`` meanwhile
        killing = KillingStorage(open_storage(local), t.point, t.n, t.after_bytes)
        mgr = CheckpointManager(
            root,
            storage_options=options,
            local=killing,  # type: ignore[arg-type]
            **{**own, **_TIER_DEFAULTS, **manager_options},
        )
    for i, step in enumerate(range(t.first_step, t.first_step + t.steps)):
        state = deterministic_state(step, tensor_bytes)
        if t.point == "staging" and i == t.n - 1:
            threading.Timer(random.uniform(0.0, 0.003), _kill_self).start()
        mgr.save(step, state).wait()
        os.write(wfd, f"{step}\n".encode())
    mgr.close()


def _multipart_uploads(storage: Any) -> list[dict[str, Any]]:
    from shardkeeper.core.garbage import list_incomplete_uploads

    return list_incomplete_uploads(storage)


def _check(storage: Any, t: Trial, acked: list[int], tensor_bytes: int, s: Summary) -> int:
    """Check the store after a trial; returns the step the next trial starts at."""
    import torch

    from shardkeeper.core.commit import committed_steps, step_dirs
    from shardkeeper.core.garbage import collect_garbage
    from shardkeeper.core.manager import CheckpointManager
    from shardkeeper.core.verify import verify_step

    where = f"trial {t.index} (kill point {t.point}, n={t.n})"
    committed = committed_steps(storage)
    attempted_max = t.first_step + t.steps - 1
    if any(c > attempted_max for c in committed):
        s.failures.append(f"{where}: a step never saved is listed: {committed}")
    if acked and (not committed or committed[-1] < acked[-1]):
        s.failures.append(f"{where}: step {acked[-1]} was acknowledged but the newest committed is {committed}")
    for c in committed:
        rep = verify_step(storage, c)
        s.steps_verified += 1
        if not rep.ok:
            s.failures.append(f"{where}: step {c} does not verify: {[str(p) for p in rep.problems]}")
    if committed:
        newest = committed[-1]
        want = deterministic_state(newest, tensor_bytes)
        got = _blank_like(want)
        with CheckpointManager(storage) as mgr:
            restored = mgr.restore(got)
        exact = (
            restored == newest
            and got["step"] == newest
            and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
        )
        if exact:
            s.restores_bit_exact += 1
        else:
            s.failures.append(f"{where}: step {newest} did not restore bit for bit")
    report = collect_garbage(storage, min_age_s=0.0, no_running_saves=True)  # the writer is dead
    s.leftovers_removed += len(report.removed_paths)
    s.incomplete_uploads_aborted += len(getattr(report, "aborted_uploads", []))
    after = committed_steps(storage)
    if after != committed:
        s.failures.append(f"{where}: gc changed the committed steps {committed} -> {after}")
    left = sorted(set(step_dirs(storage)) - set(after))
    if left:
        s.failures.append(f"{where}: gc left uncommitted step directories {left}")
    with contextlib.suppress(ImportError, AttributeError, NotImplementedError):
        if _multipart_uploads(storage):
            s.failures.append(f"{where}: incomplete multipart uploads survive gc")
    return (after[-1] + 1) if after else 0


def _check_persistent(storage: Any, t: Trial, s: Summary) -> None:
    """The persistent tier behind a killed local one: what is committed verifies, and gc
    removes the rest of an upload the kill cut short."""
    from shardkeeper.core.commit import committed_steps, step_dirs
    from shardkeeper.core.garbage import collect_garbage
    from shardkeeper.core.verify import verify_step

    where = f"trial {t.index} (kill point {t.point}, n={t.n}), the persistent tier"
    committed = committed_steps(storage)
    for c in committed:
        s.steps_verified += 1
        rep = verify_step(storage, c)
        if not rep.ok:
            s.failures.append(f"{where}: step {c} does not verify: {[str(p) for p in rep.problems]}")
    report = collect_garbage(storage, min_age_s=0.0, no_running_saves=True)
    s.leftovers_removed += len(report.removed_paths)
    if committed_steps(storage) != committed or sorted(set(step_dirs(storage)) - set(committed)):
        s.failures.append(f"{where}: gc changed the committed steps or left uncommitted directories")


def run_campaign(
    root: str,
    *,
    trials: int = 20,
    seed: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    tensor_bytes: int = 1 << 20,
    points: Sequence[str] = KILL_POINTS,
    manager_options: Mapping[str, Any] | None = None,
    trial_timeout_s: float = 120.0,
    local: str | None = None,
) -> Summary:
    """Run ``trials`` kill trials against ``root``; the returned summary lists any failure.
    ``local``: a local tier's directory (docs/tiers.md): the kills land there, ``root`` is the
    persistent tier (every other step uploaded), and both are checked after each trial."""
    import torch

    from shardkeeper.core.storage import open_storage

    torch.set_num_threads(1)
    _check_points(points)
    options = dict(storage_options or {})
    mopts = _manager_options(manager_options, local, str(root))
    persistent = open_storage(root, **options)
    storage = open_storage(local) if local is not None else persistent
    rng = random.Random(seed)
    s = Summary(root=str(root), seed=seed)
    t0 = time.monotonic()
    next_step = 0
    typical_s = 0.2  # seconds a writer lives, a moving average (random_time kills land within it)
    for i in range(trials):
        t = _draw(rng, i, next_step, points, tensor_bytes)
        s.trials += 1
        s.points[t.point] += 1
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                os.close(rfd)
                random.seed(seed * 7919 + i)
                _writer(root, options, mopts, t, tensor_bytes, wfd, local)
            except BaseException as e:
                traceback.print_exc()
                with contextlib.suppress(OSError):  # the parent reports it with the trial
                    os.write(wfd, f"!{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
                code = 3
            finally:
                os._exit(code)
        os.close(wfd)
        started = time.monotonic()
        if t.point == "random_time":  # a fraction of how long a trial's writer typically lives
            threading.Timer(t.delay_s * typical_s, lambda p=pid: _kill_quietly(p)).start()
        out = b""
        deadline = time.monotonic() + trial_timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([rfd], [], [], 0.5)
            if ready:
                chunk = os.read(rfd, 4096)
                if not chunk:
                    break
                out += chunk
        else:
            _kill_quietly(pid)
            s.failures.append(f"trial {i}: the writer did not finish in {trial_timeout_s} s")
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        lived = time.monotonic() - started
        lines = out.decode(errors="replace").splitlines()
        acked = [int(x) for x in lines if x and not x.startswith("!")]
        said = [x[1:] for x in lines if x.startswith("!")]
        s.commits_acknowledged += len(acked)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            s.killed += 1
            s.points_hit[t.point] += 1
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            s.completed += 1
            typical_s = 0.5 * typical_s + 0.5 * lived  # how long a whole writer run takes
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            why = said[0] if said else "see its traceback on stderr"
            s.writer_errors.append(f"trial {i} ({t.point}): the writer failed (exit status {code}): {why}")
        next_step = _check(storage, t, acked, tensor_bytes, s)
        if local is not None:
            _check_persistent(persistent, t, s)
    s.seconds = time.monotonic() - t0
    return s


def _check_points(points: Sequence[str]) -> None:
    bad = set(points) - set(KILL_POINTS)
    if bad:
        raise ValueError(f"unknown kill point(s) {sorted(bad)}; choose from {', '.join(KILL_POINTS)}")


#: Manager options the campaign decides itself: where the writer writes and how it is killed;
#: and the key, which its checks (verify, restore, gc on the root) do not use.
_FIXED_OPTIONS = frozenset({"storage_options", "local", "encryption", "encryption_root"})


def _scratch_local(scratch_root: str, root: str, local: str) -> str:
    """Where the scratch manager's local tier goes: beside its root, or inside it at the same
    place when ``local`` lies inside ``root`` (which a manager refuses: so is the campaign)."""
    if "://" not in root:
        real_root, real_local = os.path.realpath(root), os.path.realpath(local)
        if os.path.commonpath([real_root, real_local]) == real_root:
            return os.path.join(scratch_root, os.path.relpath(real_local, real_root))
    return os.path.join(os.path.dirname(scratch_root), "local")


def _manager_options(given: Any, local: str | None, root: str = "") -> dict[str, Any]:
    """``given`` checked before any writer starts: ``CheckpointManager`` keywords the
    campaign does not fix itself (``keep_last``, ``async_save`` and a tier's ``local_keep`` and
    ``persist_every`` override its defaults; ``async_save`` then holds for every trial), with
    values a manager takes: one is built with them on a scratch directory, as each writer's is."""
    import inspect
    import tempfile

    from shardkeeper.core import CheckpointManager

    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"manager options must be a JSON object of CheckpointManager keywords, not {given!r}")
    known = set(inspect.signature(CheckpointManager).parameters) - {"root", "self"}
    opts = dict(given or {})
    for name in opts:
        if name in _FIXED_OPTIONS:
            raise ValueError(
                f"manager option {name!r} is the campaign's own (ROOT, --storage-options and --local say where "
                f"it writes; its checks read the root without a key); remove it from --manager-options"
            )
        if name not in known:
            raise ValueError(
                f"manager option {name!r} is not a CheckpointManager keyword; the campaign would fail in "
                f"every writer. Known: {', '.join(sorted(known - _FIXED_OPTIONS))}"
            )
    with tempfile.TemporaryDirectory(prefix="shardkeeper-campaign-") as scratch:
        scratch_root = os.path.join(scratch, "root")
        scratch_local = _scratch_local(scratch_root, root, local) if local else ""
        tier: dict[str, Any] = {"local": scratch_local, **_TIER_DEFAULTS} if local else {}
        try:
            CheckpointManager(scratch_root, **{**_DEFAULTS, **tier, **opts}).close()
        except Exception as e:  # said with the real paths, not the scratch ones
            msg = str(e)
            if local:
                msg = msg.replace(scratch_local, local)
            msg = msg.replace(scratch_root, root or "ROOT")
            raise ValueError(
                f"CheckpointManager refuses the writers' manager (manager options {opts}"
                f"{', --local ' + local if local else ''}): {msg}"
            ) from e
    return opts


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardkeeper.core.testing.campaign", description=__doc__.split("\n")[0])
    p.add_argument("root", help="checkpoint root to torture (a path or URL); it should be empty")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-bytes", type=int, default=1 << 20, help="bytes of state per step")
    p.add_argument("--points", default=",".join(KILL_POINTS), help="comma-separated kill points")
    p.add_argument("--storage-options", default="{}", help="JSON: fsspec storage options")
    p.add_argument("--manager-options", default="{}", help="JSON: CheckpointManager options")
    p.add_argument("--local", metavar="DIR", help="a local tier's directory: kill there, ROOT is the persistent tier")
    a = p.parse_args(argv)
    try:
        manager_options = json.loads(a.manager_options)
        storage_options = json.loads(a.storage_options)
    except json.JSONDecodeError as e:
        p.error(f"--manager-options and --storage-options take JSON objects: {e}")
    try:  # what cannot run is said before any writer starts
        _check_points(a.points.split(","))
        _manager_options(manager_options, a.local, a.root)
        if not isinstance(storage_options, dict):
            raise ValueError(f"--storage-options must be a JSON object of fsspec options, not {storage_options!r}")
        from shardkeeper.core.storage import open_storage

        open_storage(a.root, **storage_options)
    except (ValueError, TypeError, CheckpointError) as e:
        p.error(str(e))
    summary = run_campaign(
        a.root,
        trials=a.trials,
        seed=a.seed,
        tensor_bytes=a.tensor_bytes,
        points=a.points.split(","),
        storage_options=storage_options,
        manager_options=manager_options,
        local=a.local,
    )
    json.dump(summary.to_json(), sys.stdout, indent=2)
    print()
    return 1 if summary.failures or summary.writer_errors else 0


__all__ = ["KILL_POINTS", "KillingStorage", "Summary", "Trial", "deterministic_state", "main", "run_campaign"]


if __name__ == "__main__":
    raise SystemExit(main())
