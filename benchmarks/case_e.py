"""Case (e), and one point of the world-size sweep: commit and restore planning at R ranks.

    python benchmarks/case_e.py --workdir DIR --out result.json [--quick]      # case (e), run.py's
    python benchmarks/case_e.py --ranks R --tensors T --out FILE [--layout sharded|whole|described]
                                [--workdir DIR] [--repeats N]                   # one point (scale.py's)

Case (e) is 100,000 tensors (10,000 with ``--quick``) from 8 ranks, in both layouts; run.py
runs it in its own process (with a timeout) and puts what it writes into the results.

Synthetic rank reports (``_scale_layout.py``), real code: every rank but 0 sends its report
through the real ``StoreCoordinator.report`` into a counting wrapper around an in-process
c10d ``HashStore``; the files the reports list exist at their sizes (sparse placeholders; rank
0's index file is written for real: its plan reads it). Above 128 ranks in the described
layout, the save is a group commit (``save/group.py``): rank 0 is a group of its own,
and every other group's leader collects its group's reports, checks their files, writes its
page and reports (run before the timing, one after another; ``leader_fold_s`` is the slowest,
each leader's own share when they run in parallel, and on a save's critical path before the
coordinator's part). Then, timed as ``commit_s``, rank 0's part: its own page where there are
groups (synced while it merges, as a save does), the real ``StoreCoordinator.collect`` (wait, read, parse,
validate), the merge and tiling check (``assemble_manifest``), the manifest's serialization
and the real ``commit_manifest`` (intent, checks of the files it lists, put-if-absent); then
``publish`` and every rank's ``outcome`` (counted, not timed). ``plan_s``: rank 0 reads and
validates the manifest and plans the reads of its own shard (reading its page and its index
file). DCP's ``.metadata`` for the same chunks beside it (``dcp_*``). Timings are medians
over ``--repeats``. ``described``: the row-sharded chunks recorded by their layout rule
(docs/format.md 3.8; with pages, 3.9), each rank's chunk table in its index file.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _counting import CountingStore  # noqa: E402
from _scale_layout import BLOCK, COLS, HEADER, ITEM, dcp_figures, key, n_rows, rank_chunks, row_split  # noqa: E402

N_TENSORS = 100_000
N_RANKS = 8
BIG_CHUNKS = 1_000_000  # points with more chunks are timed once by default

COUNTED = (
    "what crosses the store in one save, counted by a wrapper around a c10d HashStore driven by the real "
    "StoreCoordinator (report on every rank > 0, collect on rank 0, publish, outcome on every rank > 0), "
    "in the point's last save (from the second save on, a rank's report also deletes its previous one). Every call is one request/response "
    "to the store server on a TCPStore. store_bytes: the report messages as rank 0 receives them (multi_get)"
)


def _coordinator_class() -> Any:
    from shardkeeper.core.runtime.coordinator import StoreCoordinator

    @dataclass
    class BenchCoordinator(StoreCoordinator):
        """The real coordinator on a given store instead of a process group's."""

        store: Any = None

        @property
        def _store(self) -> Any:
            return self.store

    return BenchCoordinator


def rank_report(
    ranks: int, tensors: int, layout: str, r: int, declared: dict[str, Any], digest: str, index: Any = None
) -> Any:
    """Rank ``r``'s ``RankReport`` as its writer makes it (``save/write.py``: a ``ChunkTable``
    in ``rows_report``'s form); rank 0 declares every leaf, the others send the digest.
    ``described``: the row-sharded chunks recorded by their rule, the table going to the rank's
    index file instead: ``index(keys, table)`` writes it and returns its ``[path, size,
    digest]`` (None: not written, a placeholder entry; nothing measured reads it)."""
    from shardkeeper.core.commit.protocol import RankReport
    from shardkeeper.core.format.columns import ChunkTable
    from shardkeeper.core.format.table import rows_report

    rel = f"data/r{r:05d}-0123abcd-000.safetensors"
    if layout == "described" and index is None:  # its rows go to an index file no measured step reads
        return _described_placeholder(ranks, tensors, r, rel, declared, digest)
    keys, offset, length, offsets, shape, digests = [], [], [], [], [], []
    for i, start, count, at in rank_chunks(ranks, tensors, "sharded" if layout == "described" else layout, r):
        n = count * COLS * ITEM
        keys.append(key(i))
        offset.append(at)
        length.append(n)
        offsets += [start, 0]
        shape += [count, COLS]
        digests.append(",".join([f"{(i * 7919 + r) & (2**128 - 1):032x}"] * (-(-n // BLOCK))))
    table = ChunkTable([rel], [0] * len(keys), offset, length, [2] * len(keys), offsets, shape, digests, {}, 0)
    size = offset[-1] + length[-1] if keys else 0  # readers check every chunk lies inside its file
    files = {rel: {"size_bytes": size, "rank": r}} if keys else {}
    chunks = rows_report(keys, table)
    described: dict[str, Any] = {}
    if layout == "described":
        entry = None
        if keys:
            entry = index(keys, table) if index is not None else [f"data/r{r:05d}-0123abcd.index.json", 1, "0" * 32]
            files[entry[0]] = {"size_bytes": entry[1], "rank": r}
        chunks = rows_report([], ChunkTable([], [], [], [], [], [], [], [], {}, 0))
        described = {"digest": "rule", "index": entry, "chunk_files": [[rel, size]] if keys else []}
    return RankReport(
        rank=r,
        attempt="bench",
        declared=declared if r == 0 else {},
        declared_digest=digest,
        chunks=chunks,
        files=files,
        objects={},
        bases=[],
        extended=False,
        per_rank_prefixes=[],
        layouts=[],
        described=described,
    )


def _described_placeholder(ranks: int, tensors: int, r: int, rel: str, declared: dict[str, Any], digest: str) -> Any:
    """Rank ``r``'s report in the described layout, as it sends it (files, its index file's
    entry, no chunk rows), its index file not written (nothing measured reads it)."""
    from shardkeeper.core.commit.protocol import RankReport
    from shardkeeper.core.format.columns import ChunkTable
    from shardkeeper.core.format.table import rows_report

    _, count = row_split(n_rows(ranks), ranks, r)
    size = HEADER + count * COLS * ITEM * tensors
    files, entry, chunk_files = {}, None, []
    if count:
        entry = [f"data/r{r:05d}-0123abcd.index.json", 1, "0" * 32]
        files = {rel: {"size_bytes": size, "rank": r}, entry[0]: {"size_bytes": 1, "rank": r}}
        chunk_files = [[rel, size]]
    return RankReport(
        rank=r,
        attempt="bench",
        declared=declared if r == 0 else {},
        declared_digest=digest,
        chunks=rows_report([], ChunkTable([], [], [], [], [], [], [], [], {}, 0)),
        files=files,
        objects={},
        bases=[],
        extended=False,
        per_rank_prefixes=[],
        layouts=[],
        described={"digest": "rule", "index": entry, "chunk_files": chunk_files},
    )


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def measure_point(
    workdir: Path, ranks: int, tensors: int, layout: str = "sharded", repeats: int = 3, dcp_repeats: int | None = None
) -> dict[str, Any]:
    """One point: ``ranks`` x ``tensors`` in ``layout``; see the module docstring. DCP's figures
    are medians of ``dcp_repeats`` (default ``repeats``; 0 leaves them out)."""
    import torch.distributed as dist

    from shardkeeper.core.commit.merge import assemble_manifest, declared_digest
    from shardkeeper.core.commit.protocol import COMMITTED
    from shardkeeper.core.commit.put import commit_manifest
    from shardkeeper.core.format.table import no_gc
    from shardkeeper.core.save.group import unfold
    from shardkeeper.core.save.timings import save_timings
    from shardkeeper.core.storage import LocalStorage

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    rows = n_rows(ranks)
    declared = {key(i): ["tensor", "float32", [rows, COLS]] for i in range(tensors)}
    digest = declared_digest(declared)
    storage = LocalStorage(workdir / f"{layout}-{ranks}x{tensors}")
    store = CountingStore(dist.HashStore())
    coord = _coordinator_class()
    coords = [coord(None, r, ranks, "shardkeeper/bench", store=store) for r in range(ranks)]
    grouped = ranks > GROUP  # a group commit: pages (format.md 3.9) where leaves are described
    for c in coords:
        c.group_ranks = GROUP
    rule: dict[str, Any] = {}
    if layout == "described":  # the coordinator's own plan: every tensor by the chunk rule
        from shardkeeper.core.format.grid import Mesh, Rule

        mesh = Mesh((ranks,), tuple(range(ranks)))
        rule = {key(i): Rule(mesh, (("S", 0),), 0) for i in range(tensors)}
    commit_s: list[float] = []
    commit_cpu: list[float] = []
    phases: dict[str, dict[str, int]] = {}
    data, chunks, report_bytes = b"", 0, [0]
    for k in range(repeats):
        seq, step = k, k + 1
        store.report_bytes = []
        before = Counter(store.calls)
        led = [r for r in range(1, ranks) if coords[r].leads()] if grouped else []
        leaders = {r: rank_report(ranks, tensors, layout, r, declared, digest) for r in led}
        for r in range(1, ranks):  # every other rank's report, as its background thread sends it
            rep = leaders.get(r) if grouped else None
            if rep is None:
                rep = rank_report(ranks, tensors, layout, r, declared, digest)
                coords[r].report(seq, rep)
            _placeholder_files(storage, step, rep)  # the files the leaders or the coordinator check
        fold_s: list[float] = []
        for r, rep in leaders.items() if grouped else ():  # every other leader folds its group, in parallel
            t_fold = time.perf_counter()
            coords[r].report(seq, _fold(storage, step, [rep, *_group(coords[r], seq, step)], layout))
            fold_s.append(time.perf_counter() - t_fold)
        own = rank_report(ranks, tensors, layout, 0, declared, digest, index=_index_writer(storage, step))
        _placeholder_files(storage, step, own)
        after_report = Counter(store.calls)
        # The simulation's objects (16,384 coordinators and reports) are not the coordinator's:
        # its garbage collected, the rest frozen, so that a collection in the timed part does
        # not walk them (in a save, rank 0's heap holds none of them)
        gc.collect()
        gc.freeze()
        t0, c0 = time.perf_counter(), time.process_time()
        pages: list[Any] = []
        written = None
        if grouped:  # the coordinator is a group of its own: its page, as every leader writes one
            own, written = _fold_group(storage, step, [own], layout)
        got = coords[0].collect(seq, own, 600.0, step=step)
        after_collect = Counter(store.calls)
        if not isinstance(got, list):
            raise RuntimeError(f"collect failed: {got}")
        got, pages, refs = unfold(got)
        members = [rep.members() for rep in got]
        m = assemble_manifest(
            step,
            "bench",
            members,
            world_size=ranks,
            digest="xxh3_128",
            block_bytes=BLOCK,
            metadata={"timings": save_timings(members, time.perf_counter() - t0)},
            described=rule,
            pages=pages,
        )
        data = m.dumps()
        if written is not None:  # its page durable before its commit's intent (saving.py)
            written.result()
        commit_manifest(storage, step, m, data, bases=[], references=refs, executor=_IO)
        commit_s.append(time.perf_counter() - t0)
        commit_cpu.append(time.process_time() - c0)
        gc.unfreeze()
        chunks = (
            sum(len(rep.chunks["keys"]) for rep in got)
            if layout != "described"
            else tensors * sum(1 for r in range(ranks) if row_split(rows, ranks, r)[1])
        )
        leader_fold_s = max(fold_s, default=0.0)
        del got, members, m, own
        coords[0].publish(seq, COMMITTED)
        for r in range(1, ranks):
            coords[r].outcome(seq, 60.0, step=step)
        phases = {
            "report": dict(after_report - before),
            "collect": dict(after_collect - after_report),
            "outcome": dict(Counter(store.calls) - after_collect),
        }
        report_bytes = store.report_bytes or [0]
    plan_s: list[float] = []
    plan_cpu: list[float] = []
    ops: Any = []
    reads: Any = []
    held: Any = None
    start, count = row_split(rows, ranks, 0) if layout != "whole" else (0, rows)
    for _ in range(repeats):
        # The previous repeat's plan and manifest are freed here, untimed: freeing them (60 ms at
        # 100,000 tensors) is no part of planning, and a restore holds both until it is done.
        ops = reads = held = None
        t1, c1 = time.perf_counter(), time.process_time()
        with no_gc():  # restore_flat plans with garbage collection paused, too
            ops, reads, held = _plan(storage, start, count)
        plan_s.append(time.perf_counter() - t1)
        plan_cpu.append(time.process_time() - c1)
    del held
    res: dict[str, Any] = {
        "ranks": ranks,
        "tensors": tensors,
        "layout": layout,
        "rows": rows,
        "repeats": repeats,
        "chunks": chunks,
        "commit_s": _median(commit_s),
        "plan_s": _median(plan_s),
        "commit_cpu_s": _median(commit_cpu),  # this process's CPU time: less skewed by a loaded machine
        "commit_min_s": min(commit_s),  # the least disturbed save: a noisy machine only ever adds time
        "plan_min_s": min(plan_s),
        "group_ranks": GROUP if grouped else None,  # ranks per group leader (None: no group commit)
        "leader_fold_s": leader_fold_s if grouped else None,  # the slowest other leader's fold (last save)
        "plan_cpu_s": _median(plan_cpu),
        "manifest_bytes": len(data),
        "store_bytes": sum(report_bytes),
        "store_bytes_max_rank": max(report_bytes),
        "store_round_trips": sum(sum(p.values()) for p in phases.values()),
        "store_round_trips_by_phase": phases,
        "store_counted": COUNTED,
        "overlaps": len(ops),
        "reads": len(reads),
    }
    dcp_n = repeats if dcp_repeats is None else dcp_repeats
    if dcp_n > 0:
        res.update(
            dcp_figures(  # DCP has no rule: its metadata enumerates the described layout's chunks
                ranks,
                tensors,
                "sharded" if layout == "described" else layout,
                str(workdir / f"dcp-{layout}-{ranks}x{tensors}.metadata"),
                dcp_n,
            )
        )
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


LAYOUTS = ("sharded", "whole", "described")
#: ranks per group leader (CheckpointOptions.commit_group_ranks' default)
GROUP = 128
#: the manager's I/O threads (CheckpointOptions.io_threads' default), which check files' sizes
_IO = ThreadPoolExecutor(4, thread_name_prefix="bench-io")


def _group(coord: Any, seq: int, step: int) -> list[Any]:
    got = coord.collect_group(seq, 600.0, step=step)
    if not isinstance(got, list):
        raise RuntimeError(f"a group failed: {got}")
    return got


def _fold(storage: Any, step: int, reports: list[Any], layout: str) -> Any:
    """A leader's fold (save/group.py): check the group's files, write its page (where
    leaves are described, as a save does); it reports once the page is durable."""
    report, written = _fold_group(storage, step, reports, layout)
    if written is not None:
        written.result()
    return report


def _fold_group(storage: Any, step: int, reports: list[Any], layout: str) -> tuple[Any, Any]:
    """The coordinator's fold of its own group, as a save makes it: its page's write still
    under way (waited for before ``commit_manifest``)."""
    from shardkeeper.core.format.layout import step_dir
    from shardkeeper.core.save.group import fold_group

    return fold_group(
        storage,
        step_dir(step),
        step,
        "0123abcd",
        reports,
        algorithm="xxh3_128",
        paging=layout == "described",
        executor=_IO,
    )


def _placeholder_files(storage: Any, step: int, report: Any) -> None:
    """The files a rank's report lists, at their sizes (sparse; their leaders check them)."""
    import os

    from shardkeeper.core.format.layout import step_dir

    for rel, rec in report.files.items():
        path = Path(storage.root) / step_dir(step) / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                os.truncate(f.fileno(), rec["size_bytes"])


def _index_writer(storage: Any, step: int) -> Any:
    """Rank 0's index file of ``step``, written as a rank writes it (save/describe.py)."""

    def write(keys: list[str], table: Any) -> list[Any]:
        from shardkeeper.core.format.layout import step_dir
        from shardkeeper.core.save.index_write import write_index

        rel, size, digest, _ = write_index(storage, step_dir(step), step, 0, "0123abcd", keys, table, "xxh3_128")
        return [rel, size, digest]

    return write


def _plan(storage: Any, start: int, rows: int) -> tuple[list[Any], list[Any], Any]:
    """Rank 0's restore plan: read and validate the manifest, find the byte ranges of each of
    its target pieces (the reads themselves not included), as ``plan_restore`` does. Returns
    the ops, the reads and the manifest (which a restore holds while it reads)."""
    import torch

    from shardkeeper.core.commit.committed import load_manifest
    from shardkeeper.core.format.table import TableLeaves
    from shardkeeper.core.restore.plan import piece_ops
    from shardkeeper.core.restore.reads import plan_reads
    from shardkeeper.core.state.chunks import Piece

    local = torch.empty((rows, COLS), device="meta")
    manifest = load_manifest(storage, 1)
    leaves = manifest.leaves
    table = leaves if isinstance(leaves, TableLeaves) else None
    wanted = []
    for k in leaves:  # every leaf: rank 0's rows of each (all of them in the whole layout)
        leaf = table.head(k) if table is not None else leaves[k]
        if leaf is None or tuple(leaf.shape)[1:] != (COLS,):
            raise RuntimeError(f"{k}: not a leaf of {COLS} columns in the manifest")
        wanted.append((k, k, Piece((start, 0), (rows, COLS), local), torch.float32, ITEM))
    ops = piece_ops(leaves, wanted, 64 << 20)
    reads = plan_reads(ops, manifest.digest_block_bytes, 8 << 20)
    return ops, reads, manifest


def measure_manifest_scale(
    workdir: Path, *, n_tensors: int = N_TENSORS, n_ranks: int = N_RANKS, quick: bool = False
) -> dict[str, Any]:
    """Case (e): the row-sharded point (FSDP; ``n_ranks`` chunks a tensor: the reported
    ``commit_s``/``plan_s``), the whole-tensor one (one chunk a tensor, as ``whole``) and the
    row-sharded one recorded by its rule (as ``described``). DCP's
    figures once, for the sharded one only: within run.py's time limit for this case. ``quick``
    (the smoke run): one repeat, no DCP figures."""
    reps = 1 if quick else _default_repeats(n_ranks, n_tensors)
    sharded = measure_point(workdir, n_ranks, n_tensors, "sharded", reps, dcp_repeats=0 if quick else 1)
    whole = measure_point(workdir, n_ranks, n_tensors, "whole", reps, dcp_repeats=0)
    described = measure_point(workdir, n_ranks, n_tensors, "described", reps, dcp_repeats=0)
    return {**sharded, "layout": "row-sharded over all ranks", "whole": whole, "described": described}


def _default_repeats(ranks: int, tensors: int) -> int:
    return 1 if ranks * tensors > BIG_CHUNKS else 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where manifests and .metadata files go (default: a temporary dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="case (e) with 10,000 tensors instead of 100,000")
    ap.add_argument("--ranks", type=int, help="one point at this world size (else: case (e))")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--layout", choices=LAYOUTS, default="sharded")
    ap.add_argument("--repeats", type=int, help="timings are medians of this many (default 3, 1 above 1M chunks)")
    ap.add_argument("--no-dcp", action="store_true", help="leave DCP's figures out (they enumerate every chunk)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="case-e-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            if args.ranks is None:
                n = N_TENSORS // 10 if args.quick else N_TENSORS
                res = measure_manifest_scale(work, n_tensors=n, n_ranks=N_RANKS, quick=args.quick)
            else:
                reps = args.repeats or _default_repeats(args.ranks, args.tensors)
                res = measure_point(work, args.ranks, args.tensors, args.layout, reps, 0 if args.no_dcp else None)
        except Exception as e:  # a broken measurement must not lose the rest of the run
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
