"""One rank's part of a save, on its background thread: its shards written (``write.py``),
its index file when its layouts are described (``index_write.py``), and the ``RankReport``
it sends towards the coordinator."""

from __future__ import annotations

import logging
import time
from typing import Any

from shardkeeper.core import metrics
from shardkeeper.core.codec import CodecState
from shardkeeper.core.commit.protocol import COORDINATOR, RankReport, Timings
from shardkeeper.core.format.layout import data_prefixes, step_dir
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.save.index_write import index_report
from shardkeeper.core.save.job import SaveJob
from shardkeeper.core.save.replicas import with_replicas
from shardkeeper.core.save.write import write_shards

log = logging.getLogger(__name__)


def write_rank(ctx: ManagerContext, codec_state: CodecState, job: SaveJob, stall_s: float, t0: float) -> RankReport:
    """This rank's shards of ``job`` written under its step directory, and its report
    (``stall_s``: what ``save()`` stalled; ``t0``: when the writing began)."""
    settings = ctx.settings
    codecs = codec_state.for_save(ctx.read_storage, job.step, settings.digest, settings.digest_block_bytes)
    res = write_shards(
        ctx.storage,
        step_dir(job.step),
        job.groups,
        job.spans,
        rank=ctx.rank,
        attempt=job.attempt,
        algorithm=settings.digest,
        block_bytes=settings.digest_block_bytes,
        executor=ctx.io,
        codecs=codecs,
        memo=job.plan.memo,
        prefixes=data_prefixes(settings.data_prefixes, ctx.world_size),
        sync=not job.plan.described,  # (then once, with the index file: index_report)
        logical=settings.logical_check != "off",
    )
    declarations = job.plan.report_declarations(coordinator=ctx.rank == COORDINATOR)
    chunks, files, described = res.chunks, res.files, dict[str, Any]()
    if job.plan.described:
        chunks, files, described = index_report(
            ctx.storage,
            step_dir(job.step),
            job.step,
            ctx.rank,
            job.attempt,
            res.chunks,
            res.files,
            job.plan,
            settings.digest,
            data_prefixes(settings.data_prefixes, ctx.world_size),
        )
    chunks = with_replicas(chunks, job.replicas)  # (after the split: it keeps only the chunk records)
    report = RankReport(
        rank=ctx.rank,
        attempt=job.attempt,
        declared=declarations["declared"],
        declared_digest=declarations["declared_digest"],
        chunks=chunks,
        files=files,
        objects=job.objects,
        bases=[codecs.reuse.base.step] if codecs.reuse is not None and codecs.reuse.usable else [],
        extended=job.extended,
        per_rank_prefixes=job.plan.per_rank_prefixes,
        layouts=sorted(job.plan.layouts),
        timings=Timings(stall_s=stall_s, write_s=time.perf_counter() - t0, sync=job.sync),
        described=described,
    )
    log.info(
        "rank %d step %d: wrote %d bytes in %.3f s", ctx.rank, job.step, res.bytes_written, time.perf_counter() - t0
    )
    metrics.record(metrics.BYTES_WRITTEN, res.bytes_written, rank=ctx.rank, step=job.step)
    return report


__all__ = ["write_rank"]
