"""The one progress schema every adapter writes and reads: the ``progress`` namespace.

A checkpoint's training position, in keys every framework reads the same way:

=========================  ====  ==========================================================
``progress/schema``        int   :data:`PROGRESS_SCHEMA`: this layout (absent: an older one)
``progress/step``          int   the training step count at the save (the framework's own
                                 step counter; normally the checkpoint's step number)
``progress/epoch``         int   completed epochs (0 where the framework counts none)
``progress/samples``       int   samples consumed, where the framework counts them
``progress/<framework>/``  any   one framework's own counters (DeepSpeed's skipped steps and
                                 loss scaler, Lightning's loop state, Accelerate's save
                                 iteration), read back only by that framework
=========================  ====  ==========================================================

Adapters save a :func:`progress_state` (or a :class:`ProgressTarget`) as their ``progress``
entry, however the manager that saves it was made (the entry marks its own layout; the
adapters' managers also name it in the manifest's metadata, for tools). They read it with :func:`read_progress`, from the
manifest alone (progress values are JSON values stored inline), from the step actually
restored. A checkpoint without the schema (a plain core save, or one written before the
schema existed) still resumes its step count: the step is the checkpoint's step number, and
the epoch and framework counters come from the older layouts where they exist.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.format.manifest import Manifest

#: ``progress/schema`` (and ``progress_schema`` in adapters' manifest metadata): the layout above.
PROGRESS_SCHEMA = 1
#: The namespace of the progress entry in the canonical state.
NAMESPACE = "progress"
#: The largest count read back (the frameworks keep their counters as int64).
MAX_COUNT = 2**63 - 1
#: The keys every framework shares; any other key under ``progress/`` names a framework.
SHARED_KEYS = ("schema", "step", "epoch", "samples")

# Where adapters kept their counters before the schema (at the top of ``progress/``).
_LEGACY_COUNTERS = {
    "deepspeed": ("global_step", "global_samples", "skipped_steps", "micro_steps", "loss_scaler"),
    "lightning": ("global_step", "epoch", "loops"),
    "accelerate": ("iteration", "step"),
}


@dataclass(frozen=True)
class Progress:
    """A checkpoint's training position, as :func:`read_progress` finds it."""

    step: int
    """The step count a resume continues from."""
    epoch: int = 0
    samples: int | None = None
    counters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Each framework's own counters, by framework name (absent: that framework wrote none)."""
    schema: int | None = None
    """``PROGRESS_SCHEMA`` when the checkpoint was written with the schema, else None."""
    checkpoint_step: int | None = None
    """The step number of the checkpoint it was read from."""

    def of(self, framework: str) -> dict[str, Any]:
        """``framework``'s own counters (``{}``: the checkpoint holds none of them)."""
        return dict(self.counters.get(framework) or {})

    def count(self, framework: str, key: str, default: int) -> int:
        """``framework``'s counter ``key`` if it is a count (an int from 0 to 2**63 - 1), else
        ``default``, with a warning when the checkpoint holds something else there."""
        value: Any = (self.counters.get(framework) or {}).get(key)
        if _is_count(value):
            return int(value)
        if value is not None:
            warnings.warn(
                f"the checkpoint of step {self.checkpoint_step}: progress/{framework}/{key} is {_shown(value)}, "
                f"not a count; {default} is used instead",
                stacklevel=3,
            )
        return default


class ProgressTarget:
    """A ``progress`` entry an adapter puts in its state: saved as ``state_dict()`` gives it
    (a :func:`progress_state`); on restore the manager hands it the checkpoint's
    :class:`Progress` (read from the manifest of the step actually restored) instead of
    restoring its keys one by one, so it resumes from checkpoints of every framework and layout.
    """

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_progress(self, progress: Progress) -> None:
        raise NotImplementedError

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """A restore by a caller that restored ``progress/*`` itself: the schema's values."""
        self.load_progress(from_tree(dict(sd), schema=PROGRESS_SCHEMA))


def split_targets(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, ProgressTarget]]:
    """``state`` without its :class:`ProgressTarget` entries, and those entries. Without any,
    ``state`` itself (a restore replaces its top-level JSON values in place); with some, a copy
    whose top-level values the caller copies back (:func:`merge_back`)."""
    targets = {k: v for k, v in state.items() if isinstance(v, ProgressTarget)}
    if not targets:
        return state, {}
    return {k: v for k, v in state.items() if k not in targets}, targets


def merge_back(state: Mapping[str, Any], rest: Mapping[str, Any]) -> None:
    """Top-level values a restore replaced in ``rest`` (the copy :func:`split_targets` made),
    into ``state``."""
    if rest is state or not isinstance(state, MutableMapping):
        return
    for k, v in rest.items():
        if state.get(k) is not v:
            state[k] = v


def progress_state(
    *, step: int, epoch: int = 0, samples: int | None = None, counters: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``progress`` entry of a save: the shared keys and each framework's ``counters``
    (a mapping of JSON values, or an object with ``state_dict()``). A bool or a negative count
    is a programming error of the adapter: ``ValueError``."""
    _check_count("step", step)
    _check_count("epoch", epoch)
    entry: dict[str, Any] = {"schema": PROGRESS_SCHEMA, "step": int(step), "epoch": int(epoch)}
    if samples is not None:
        _check_count("samples", samples)
        entry["samples"] = int(samples)
    for name, value in (counters or {}).items():
        if name in SHARED_KEYS:
            raise ValueError(f"a framework cannot be named {name!r}: that is a shared progress key")
        entry[name] = value
    return entry


def read_progress(manifest: Manifest) -> Progress:
    """The position of the checkpoint ``manifest`` describes.

    With the schema (``progress/schema``): ``progress/step``, ``progress/epoch``, ``progress/samples`` and every
    ``progress/<framework>/...``. Without it: the checkpoint's step number, and the counters of
    the adapter that wrote it from its older layout (DeepSpeed's, Lightning's and Accelerate's
    oldest at the top of ``progress/``; Accelerate's next under ``progress/accelerate/``;
    Lightning's under ``extra/lightning/progress/`` when it ran on DeepSpeed).
    """
    tree = object_tree(manifest.leaves, NAMESPACE)
    if "schema" not in tree:
        return _legacy(manifest, tree)
    bad = _problems(tree)
    if bad:
        warnings.warn(
            f"the checkpoint of step {manifest.step}: {'; '.join(bad)}; its step count resumes from the "
            f"checkpoint's step number {manifest.step} (a counter that is not a count is not trusted)",
            stacklevel=3,
        )
        return _legacy(manifest, {})
    return from_tree(tree, schema=PROGRESS_SCHEMA, checkpoint_step=manifest.step)


def _problems(tree: Mapping[str, Any]) -> list[str]:
    """What makes a schema ``progress`` entry untrustworthy (empty: nothing)."""
    schema = tree.get("schema")
    if schema != PROGRESS_SCHEMA or isinstance(schema, bool):
        return [f"progress/schema is {schema!r}, not one this shardkeeper reads ({PROGRESS_SCHEMA})"]
    bad = []
    for key in SHARED_KEYS[1:]:
        if (key in tree or key == "step") and not _is_count(tree.get(key)):
            bad.append(f"progress/{key} is {_shown(tree.get(key))}, not a count (an int from 0 to 2**63 - 1)")
    return bad


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _legacy(manifest: Manifest, tree: dict[str, Any]) -> Progress:
    """Progress of a checkpoint written before the schema, recognised by its keys (the
    DeepSpeed counters were also saved through plain core managers, labelled ``torch``)."""
    written_by = framework_of(manifest)
    counters: dict[str, dict[str, Any]] = {}
    if isinstance(tree.get("accelerate"), Mapping):
        counters["accelerate"] = dict(tree.pop("accelerate"))
    elif written_by == "accelerate" or ("iteration" in tree and "step" in tree and "loops" not in tree):
        counters["accelerate"] = {k: tree[k] for k in _LEGACY_COUNTERS["accelerate"] if k in tree}
    lightning_on_ds = object_tree(manifest.leaves, "extra/lightning/progress")
    if lightning_on_ds:
        counters["lightning"] = lightning_on_ds
    elif written_by == "lightning" or "loops" in tree:
        counters["lightning"] = {k: tree[k] for k in _LEGACY_COUNTERS["lightning"] if k in tree}
    if "skipped_steps" in tree and "global_step" in tree:
        counters["deepspeed"] = {k: tree[k] for k in _LEGACY_COUNTERS["deepspeed"] if k in tree}
    lightning = counters.get("lightning", {})
    step = lightning.get("global_step", counters.get("deepspeed", {}).get("global_step"))
    return Progress(
        step=_int(step, int(manifest.step)),
        epoch=_int(lightning.get("epoch"), 0),
        samples=_opt_int(tree.get("global_samples")),
        counters={k: v for k, v in counters.items() if v},
        schema=None,
        checkpoint_step=manifest.step,
    )


def from_tree(tree: Mapping[str, Any], *, schema: int | None, checkpoint_step: int | None = None) -> Progress:
    """A :class:`Progress` from the nested values of a schema ``progress`` entry."""
    counters = {k: dict(v) for k, v in tree.items() if k not in SHARED_KEYS and isinstance(v, Mapping)}
    return Progress(
        step=_int(tree.get("step"), 0),
        epoch=_int(tree.get("epoch"), 0),
        samples=_opt_int(tree.get("samples")),
        counters=counters,
        schema=schema,
        checkpoint_step=checkpoint_step,
    )


def framework_of(manifest: Manifest) -> str:
    """The framework that wrote the checkpoint (``torch`` for a plain core save); older
    Lightning checkpoints name it ``framework_adapter``."""
    meta = manifest.metadata
    name = meta.get("framework")
    if name in (None, "torch") and meta.get("framework_adapter"):
        name = meta["framework_adapter"]
    return str(name or "torch")


def object_tree(leaves: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The JSON values stored under ``prefix/``, nested back into dicts (tensor and bytes
    leaves are left out: progress holds none)."""
    out: dict[str, Any] = {}
    head = prefix.rstrip("/") + "/"
    for key, rec in leaves.items():
        if not key.startswith(head) or rec.kind != "object":
            continue
        parts = key[len(head) :].split("/")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = rec.value
    return out


def _is_count(value: Any) -> bool:
    """A non-negative int that fits a framework's int64 counters."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _check_count(name: str, value: Any) -> None:
    if not _is_count(value):
        raise ValueError(f"progress: {name} must be a non-negative int below 2**63, got {value!r}")


def _int(value: Any, default: int) -> int:
    return int(value) if _is_count(value) else default


def _opt_int(value: Any) -> int | None:
    return int(value) if _is_count(value) else None


__all__ = [
    "NAMESPACE",
    "PROGRESS_SCHEMA",
    "SHARED_KEYS",
    "Progress",
    "ProgressTarget",
    "framework_of",
    "from_tree",
    "merge_back",
    "object_tree",
    "progress_state",
    "read_progress",
    "split_targets",
]
