"""Checkpoint metrics: an in-process registry, exported to Prometheus and to the log.

The core records into :data:`REGISTRY` (thread-safe, no dependency); each record is also a
log record on the logger ``shardkeeper.metrics`` (level DEBUG, ``extra={"metric", "value",
"labels", "rank", "step"}``) so any log pipeline can pick them up. Values are per process, i.e.
per rank.

===========================================  ==========  =========================================
name                                         kind        meaning (labels)
===========================================  ==========  =========================================
``checkpoint_save_seconds``                  histogram   save() to committed, as this rank saw it
``checkpoint_stall_seconds``                 histogram   time save() blocked the caller
``checkpoint_bytes_written_total``           counter     shard bytes this rank wrote
``checkpoint_upload_errors_total``           counter     storage errors (``op``, ``outcome``:
                                                         ``retried`` or ``failed``)
``checkpoint_last_committed_step``           gauge       newest step this process saw committed
``checkpoint_after_commit_errors_total``     counter     failures after a commit, logged instead of
                                                         failing the committed save (``what``:
                                                         ``latest_hint``, ``catalog``,
                                                         ``catalog_forget``, ``retention``)
``checkpoint_restore_seconds``               histogram   restore() of one step
``checkpoint_bytes_read_total``              counter     bytes this rank read to restore
===========================================  ==========  =========================================

Prometheus: ``pip install shardkeeper-core[metrics]``, then either
``shardkeeper.core.metrics.start_http_server(9100)`` (a ``/metrics`` endpoint on a thread) or
``register_collector()`` into your own ``prometheus_client`` registry.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("shardkeeper.metrics")

DEFAULT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

LabelKey = tuple[tuple[str, str], ...]


def _key(labels: Mapping[str, Any]) -> LabelKey:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


@dataclass
class Metric:
    """One named metric and its samples per label set."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    buckets: tuple[float, ...] = DEFAULT_BUCKETS
    _values: dict[LabelKey, float] = field(default_factory=dict)
    _hist: dict[LabelKey, list[float]] = field(default_factory=dict)  # bucket counts, +Inf, sum
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if self.kind != "counter" or amount < 0:
            raise ValueError(f"{self.name}: inc({amount}) on a {self.kind}")
        k = _key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount

    def set(self, value: float, **labels: Any) -> None:
        if self.kind != "gauge":
            raise ValueError(f"{self.name}: set() on a {self.kind}")
        with self._lock:
            self._values[_key(labels)] = float(value)

    def observe(self, value: float, **labels: Any) -> None:
        if self.kind != "histogram":
            raise ValueError(f"{self.name}: observe() on a {self.kind}")
        k = _key(labels)
        with self._lock:
            h = self._hist.setdefault(k, [0.0] * (len(self.buckets) + 2))
            h[bisect.bisect_left(self.buckets, value)] += 1  # index len(buckets) is +Inf
            h[-1] += value

    def value(self, **labels: Any) -> float:
        """A counter's or gauge's value (0 if never recorded); a histogram's count."""
        k = _key(labels)
        with self._lock:
            if self.kind == "histogram":
                return sum(self._hist.get(k, [0.0])[:-1])
            return self._values.get(k, 0.0)

    def total(self) -> float:
        """Sum over every label set (a histogram: its observation count)."""
        with self._lock:
            if self.kind == "histogram":
                return sum(sum(h[:-1]) for h in self._hist.values())
            return sum(self._values.values())

    def samples(self) -> list[tuple[LabelKey, Any]]:
        """(labels, value) pairs; a histogram's value is (cumulative bucket counts, count, sum)."""
        with self._lock:
            if self.kind != "histogram":
                return sorted(self._values.items())
            out = []
            for k, h in sorted(self._hist.items()):
                cum, acc = [], 0.0
                for c in h[:-1]:
                    acc += c
                    cum.append(acc)
                out.append((k, (cum, acc, h[-1])))
            return out

    def reset(self) -> None:
        with self._lock:
            self._values.clear()
            self._hist.clear()


class Registry:
    """Named metrics of one process."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def metric(self, name: str, kind: str, help: str) -> Metric:
        with self._lock:
            m = self._metrics.get(name)
            if m is None:
                m = self._metrics[name] = Metric(name, kind, help)
            elif m.kind != kind:
                raise ValueError(f"metric {name} is a {m.kind}, not a {kind}")
            return m

    def __getitem__(self, name: str) -> Metric:
        return self._metrics[name]

    def __iter__(self) -> Iterator[Metric]:
        with self._lock:
            return iter(list(self._metrics.values()))

    def reset(self) -> None:
        for m in self:
            m.reset()


REGISTRY = Registry()
SAVE_SECONDS = REGISTRY.metric("checkpoint_save_seconds", "histogram", "Seconds from save() to commit")
STALL_SECONDS = REGISTRY.metric("checkpoint_stall_seconds", "histogram", "Seconds save() blocked the caller")
BYTES_WRITTEN = REGISTRY.metric("checkpoint_bytes_written_total", "counter", "Shard bytes written")
UPLOAD_ERRORS = REGISTRY.metric(
    "checkpoint_upload_errors_total", "counter", "Storage errors, retried or failed, by operation"
)
LAST_COMMITTED_STEP = REGISTRY.metric("checkpoint_last_committed_step", "gauge", "Newest committed step")
AFTER_COMMIT_ERRORS = REGISTRY.metric(
    "checkpoint_after_commit_errors_total", "counter", "Failures after a commit, logged, never failing the save"
)
RESTORE_SECONDS = REGISTRY.metric("checkpoint_restore_seconds", "histogram", "Seconds to restore a step")
BYTES_READ = REGISTRY.metric("checkpoint_bytes_read_total", "counter", "Bytes read to restore")
LOGICAL_MISMATCHES = REGISTRY.metric(
    "checkpoint_logical_mismatches_total",
    "counter",
    "Tensors whose logical digests disagreed (replicas at a save, or a restored tensor and its record)",
)


def record(metric: Metric, value: float, *, rank: int | None = None, step: int | None = None, **labels: Any) -> None:
    """Record ``value`` (inc / set / observe by the metric's kind) and log it."""
    if not math.isfinite(value):
        return
    if metric.kind == "counter":
        metric.inc(value, **labels)
    elif metric.kind == "gauge":
        metric.set(value, **labels)
    else:
        metric.observe(value, **labels)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "%s %s %g",
            metric.name,
            labels or "",
            value,
            extra={"metric": metric.name, "value": value, "labels": dict(labels), "rank": rank, "step": step},
        )


# -- Prometheus ---------------------------------------------------------------------------------


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "exporting shardkeeper metrics to Prometheus needs prometheus_client: "
            "pip install 'shardkeeper-core[metrics]'"
        ) from e
    return prometheus_client


class _Collector:
    """A ``prometheus_client`` collector over a :class:`Registry` (read at scrape time)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        for m in self._registry:
            samples = m.samples()
            names = sorted({k for labels, _ in samples for k, _ in labels})
            fam: Any
            if m.kind == "counter":
                fam = CounterMetricFamily(m.name, m.help, labels=names)
            elif m.kind == "gauge":
                fam = GaugeMetricFamily(m.name, m.help, labels=names)
            else:
                fam = HistogramMetricFamily(m.name, m.help, labels=names)
            for labels, value in samples:
                d = dict(labels)
                values = [d.get(n, "") for n in names]
                if m.kind == "histogram":
                    cum, count, total = value
                    bounds = [repr(float(b)) for b in m.buckets] + ["+Inf"]
                    fam.add_metric(values, list(zip(bounds, cum)), total)
                else:
                    fam.add_metric(values, value)
            yield fam


_registered: dict[int, Any] = {}
_registered_lock = threading.Lock()


def register_collector(prometheus_registry: Any = None, registry: Registry = REGISTRY) -> Any:
    """Register ``registry`` with a ``prometheus_client`` registry (default: its global one), once."""
    prom = _prometheus()
    target = prometheus_registry if prometheus_registry is not None else prom.REGISTRY
    with _registered_lock:
        if id(target) not in _registered:
            collector = _Collector(registry)
            target.register(collector)
            _registered[id(target)] = collector
        return _registered[id(target)]


def start_http_server(port: int, addr: str = "0.0.0.0", registry: Registry = REGISTRY) -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns what prometheus_client does.

    Uses a ``prometheus_client`` registry of its own, so that only shardkeeper's metrics are
    served (register_collector() adds them to yours instead).
    """
    prom = _prometheus()
    target = prom.CollectorRegistry(auto_describe=False)
    register_collector(target, registry)
    return prom.start_http_server(port, addr=addr, registry=target)


__all__ = [
    "AFTER_COMMIT_ERRORS",
    "BYTES_READ",
    "BYTES_WRITTEN",
    "LAST_COMMITTED_STEP",
    "REGISTRY",
    "RESTORE_SECONDS",
    "SAVE_SECONDS",
    "STALL_SECONDS",
    "UPLOAD_ERRORS",
    "Metric",
    "Registry",
    "record",
    "register_collector",
    "start_http_server",
]
