"""Group commit: a group leader's half of a save at a world above ``commit_group_ranks``.

A leader (the first rank of each ``commit_group_ranks`` ranks after the coordinator, which is
a group of its own) collects its group's reports, writes the group's *page* (their files,
index entries and chunk-file ends, format/pages.py) durably while it checks that each of
their files is there at the size its rank wrote, and folds the reports into one: the ranks whose reports are then equal (every rank that
wrote only described leaves, apart from its timings) count once, the others travel inside
it (the sums of the replicated copies they hold are folded into one member first, so that
ranks differing only by their copy fold too). The coordinator merges one report per group (``unfold``), so its work, the store bytes
it reads and the manifest stay the same size from 64 ranks to 16,384 (docs/protocol.md,
"Group commit").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import Any

from shardkeeper.core.commit.protocol import RankReport, Timings
from shardkeeper.core.commit.put import check_files
from shardkeeper.core.errors import CheckpointSaveError
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.fastjson import orjson
from shardkeeper.core.format.layout import PAGES_DIR, page_file
from shardkeeper.core.format.pages import encode_page, parse_page
from shardkeeper.core.format.replica_copies import REPLICAS, fold
from shardkeeper.core.save.logical import with_group_sums
from shardkeeper.core.save.write import write_durably
from shardkeeper.core.storage.base import Storage


def fold_group(
    storage: Storage,
    step_dir: str,
    step: int,
    attempt: str,
    reports: Sequence[RankReport],
    *,
    algorithm: str,
    paging: bool = True,
    executor: Any = None,
) -> tuple[RankReport, Future[None] | None]:
    """The leader's report for its group (``reports``: the leader's own first, then its
    ranks' in rank order), and its page's write, still under way on ``executor`` (None:
    ended): a leader waits for it before it reports (only a durable page is reported), the
    coordinator before it announces its commit (its page's syncs overlap its merge). Raises
    ``CorruptCheckpointError`` naming the rank whose file is missing or of another size,
    once the write has ended. ``paging`` False (a save without described leaves, whose chunk
    table names every file anyway): no page, the reports folded as they are. ``executor``:
    where the page is written (and, on a remote storage, the files' sizes asked for)."""
    reports, copies = _without_replicas(reports)
    leader = reports[0]
    if not paging:
        folded = _folded([(rep, rep.files, rep.described) for rep in reports], leader, None, [])
        return _with_replicas(folded, copies), None
    paged: dict[str, dict[str, Any]] = {}
    index: list[Any] = []
    ends: dict[str, int] = {}
    residuals: list[Residual] = []
    for rep in reports:
        kept = _chunk_paths(rep.chunks)  # files the manifest's chunk table names stay in it
        own: dict[str, dict[str, Any]] = {}
        for rel, rec in rep.files.items():
            (own if rel in kept else paged)[rel] = rec
        d = rep.described
        index.append(d.get("index") if d else None)
        for rel, end in d.get("chunk_files", ()) if d else ():
            ends[rel] = max(ends.get(rel, 0), end)
        described = {"digest": d["digest"], "index": None, "chunk_files": []} if d else {}
        residuals.append((rep, own, described))
    rel = page_file(leader.rank, attempt)
    data = encode_page(step, leader.rank, paged, index, ends)
    try:  # the reader's own check of these bytes (as a manifest's before its commit): a page that
        # every restore would refuse fails the save here, instead of a commit never restorable
        parse_page(data, step=step, first=leader.rank, count=len(reports))
    except ValueError as e:
        last = leader.rank + len(reports) - 1
        raise CheckpointSaveError(
            f"step {step}: the page of ranks {leader.rank} to {last} built by their group leader (rank "
            f"{leader.rank}) is refused by the reader ({e}); nothing was committed",
            step=step,
        ) from None
    # the page is written (its fsyncs on an I/O thread) while the group's files are checked:
    # a page of a save that then fails is an uncommitted file, as any rank's data file is
    written = executor.submit(write_durably, storage, step_dir, rel, data, PAGES_DIR) if executor else None
    try:
        # every file of the group is there at the size its rank wrote (the coordinator checks
        # the files its manifest lists itself, after announcing its commit)
        paths = {f"{step_dir}/{name}": rec for name, rec in paged.items()}
        check_files(storage, paths, dict.fromkeys(paths, 0), executor)
        if written is None:
            write_durably(storage, step_dir, rel, data, PAGES_DIR)
        nbytes = sum(int(r["size_bytes"]) for r in paged.values())
        page = [rel, len(data), digest_function(algorithm)(data), len(paged), nbytes]
        # files of earlier steps the group's index rows reference (an incremental save): the
        # coordinator's commit intent names them and checks them, as for its own references
        refs = [[p, e] for p, e in sorted(ends.items()) if p.startswith("../")]
        folded = _folded(residuals, leader, page, refs, {rel: {"size_bytes": len(data), "rank": leader.rank}})
        folded = with_group_sums(folded, reports)  # (their described sums, added: not in the signatures)
        folded = _with_replicas(folded, copies)
    except BaseException:
        if written is not None:  # the check's (or the fold's) error is the one to report; the write ends first
            wait([written])
        raise
    return folded, written


def _without_replicas(reports: Sequence[RankReport]) -> tuple[Sequence[RankReport], dict[str, Any] | None]:
    """The group's reports without their ``replicas`` members, and those members folded into
    one (format/replica_copies.py): ranks that differ only by the copy they hold fold alike.
    As they are (and None) when none has one, or one is malformed (the coordinator names it)."""
    members = [(r.rank, r.chunks.get(REPLICAS)) for r in reports]
    if all(m is None for _, m in members):
        return reports, None
    try:
        folded = fold(members)
    except ValueError:
        return reports, None
    return [replace(r, chunks={k: v for k, v in r.chunks.items() if k != REPLICAS}) for r in reports], folded


def _with_replicas(report: RankReport, member: dict[str, Any] | None) -> RankReport:
    return report if member is None else replace(report, chunks={**report.chunks, REPLICAS: member})


#: A rank's report and what of it stays in the leader's: the files and ``described`` member
#: the page does not take (the report itself is copied only once per kind).
Residual = tuple[RankReport, dict[str, Any], dict[str, Any]]


def _folded(
    residuals: list[Residual],
    leader: RankReport,
    page: list[Any] | None,
    refs: list[Any],
    page_files: dict[str, Any] | None = None,
) -> RankReport:
    """Equal reports (but for their rank and timings) count once: the leader's kind, then one
    report per other kind, carried in the leader's; the timings are the group's worst. The
    page itself is a file of the leader's report (added after the comparison)."""
    kinds: dict[bytes, tuple[Residual, list[int]]] = {}
    for res in residuals:
        sig = _signature(*res)
        got = kinds.get(sig)
        if got is None:
            kinds[sig] = (res, [res[0].rank])
        else:
            got[1].append(res[0].rank)
    ((rep, files, described), ranks), *rest = kinds.values()
    others = [replace(r, files=f, described=d, ranks=_runs(rs), timings=Timings()) for (r, f, d), rs in rest]
    ts = [r.timings for r, _, _ in residuals]
    timings = Timings(max(t.stall_s for t in ts), max(t.write_s for t in ts), leader.timings.sync)
    return replace(
        rep,
        files={**files, **(page_files or {})},
        described=described,
        ranks=_runs(ranks),
        timings=timings,
        group={"count": len(residuals), "page": page, "others": others, "refs": refs},
    )


def unfold(
    reports: Sequence[RankReport],
) -> tuple[list[RankReport], list[tuple[int, int, list[Any]]], dict[str, int]]:
    """The coordinator's view of the leaders' reports: every distinct report (the leaders'
    and the ones they carry), each group's ``(first rank, count, page entry)``, and the
    files of earlier steps the pages' ranks reference, with the end of the last byte."""
    out: list[RankReport] = []
    pages: list[tuple[int, int, list[Any]]] = []
    refs: dict[str, int] = {}
    for rep in reports:
        out.append(rep)
        if rep.group:
            if rep.group["page"] is not None:
                pages.append((rep.rank, rep.group["count"], rep.group["page"]))
            out.extend(rep.group["others"])
            for rel, end in rep.group["refs"]:
                refs[rel] = max(refs.get(rel, 0), end)
    return out, pages, refs


def _chunk_paths(chunks: dict[str, Any]) -> set[str]:
    table = chunks.get("table")
    if isinstance(table, ChunkTable):
        return set(table.paths) if len(table) else set()
    if isinstance(table, dict) and chunks.get("keys"):
        return {p for p in table.get("files", ()) if isinstance(p, str)}
    return set()


def _signature(rep: RankReport, files: dict[str, Any], described: dict[str, Any]) -> bytes:
    """The report with ``files`` and ``described`` but for its rank and timings, as canonical
    JSON (orjson where it can: a leader folds its group while the coordinator waits for it)."""
    doc = rep.to_json()
    doc["files"] = files
    if described:
        doc["described"] = described
    else:
        doc.pop("described", None)
    for name in ("rank", "timings", "ranks"):
        doc.pop(name, None)
    if orjson is not None and not rep.extended:  # (orjson writes NaN as null: not canonical)
        try:
            return bytes(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS))
        except (TypeError, orjson.JSONEncodeError):  # NaN, integers beyond 64 bits
            pass
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _runs(ranks: list[int]) -> list[list[int]]:
    """Sorted ranks as ``[first, last]`` runs."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


__all__ = ["fold_group", "unfold"]
