"""What the logical-digest matrix tests share (every suite): a checkpoint's recorded digests,
read through the public ``shardkeeper inspect ROOT STEP --json``, compared with
``logical_digest`` of tensors built in one process.

``expected_digests`` computes the single-process side; ``compare`` says which keys differ or
are missing; ``one_ulp_off`` gives the same tensors with one element of one tensor moved to
the next float, which every matrix test feeds to ``compare`` to show that it can fail.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping
from contextlib import redirect_stdout
from pathlib import Path

import torch


def inspect_digests(root: str | Path, step: int) -> dict[str, str | None]:
    """Each tensor and bytes leaf's ``logical_digest`` as ``shardkeeper inspect ROOT STEP --json``
    prints it (run in this process)."""
    from shardkeeper.core.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["inspect", str(root), str(step), "--json"])
    assert code == 0, f"shardkeeper inspect {root} {step} --json exited {code}: {buf.getvalue()[-2000:]}"
    doc = json.loads(buf.getvalue())
    return {leaf["key"]: leaf.get("logical_digest") for leaf in doc["leaves"] if leaf["kind"] != "object"}


def expected_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``logical_digest`` of each tensor, keyed as given."""
    from shardkeeper.core import logical_digest

    return {k: logical_digest(v.detach().contiguous()) for k, v in tensors.items()}


def compare(recorded: Mapping[str, str | None], expected: Mapping[str, str], *, where: str) -> list[str]:
    """Every key of ``expected`` whose recorded digest differs or is missing, as a sentence."""
    out = []
    for k, want in sorted(expected.items()):
        got = recorded.get(k, "(no such leaf)")
        if got != want:
            out.append(f"{where}: {k}: recorded {got}, one process gives {want}")
    return out


def one_ulp_off(tensors: Mapping[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """``tensors`` with element 0 of ``key`` moved one ulp (towards +inf); the others as given."""
    out = dict(tensors)
    t = tensors[key].detach().clone()
    flat = t.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=t.dtype))
    assert not torch.equal(t, tensors[key]), f"{key}: one ulp changed nothing"
    out[key] = t
    return out


def assert_matrix(
    roots: Iterable[tuple[str, str | Path, int]], tensors: Mapping[str, torch.Tensor], *, min_keys: int = 1
) -> None:
    """Every ``(name, root, step)`` records, for every key of ``tensors``, the digest that
    ``logical_digest`` gives in this process; and the same compare with one tensor one ulp off
    fails for every checkpoint (the compare can fail)."""
    assert len(tensors) >= min_keys, f"only {sorted(tensors)} to compare"
    expected = expected_digests(tensors)
    perturbed = expected_digests(one_ulp_off(tensors, sorted(tensors)[0]))
    wrong: list[str] = []
    for name, root, step in roots:
        recorded = inspect_digests(root, step)
        wrong += compare(recorded, expected, where=name)
        assert compare(recorded, perturbed, where=name), f"{name}: a one-ulp change went unseen"
    assert not wrong, "\n".join(wrong[:20])


__all__ = ["assert_matrix", "compare", "expected_digests", "inspect_digests", "one_ulp_off"]
