"""Tensors the format cannot store are refused by ``save()``, naming the step, the rank, the
key and the remedy.

The format stores dense (strided) tensors with data. A nested tensor (strided or jagged), a
sparse or mkldnn layout, or a tensor on the meta device, is a ``StateMismatchError`` from
``save()`` on the caller's thread, before anything is written, as a dtype the format lacks
(complex) is: never torch's own error (a nested tensor's fails the plan, the others' the copy).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager, StateMismatchError
from shardkeeper.core.save.stage import DIRECT_MIN_BYTES


def _mkldnn(n: int) -> torch.Tensor:
    return torch.ones(n, n).to_mkldnn()


NESTED = r"is a nested tensor \(.*\.unbind\(\) gives a list of tensors, or torch\.nested\.to_padded_tensor\(t, 0\.0\)"
MAKERS: dict[str, tuple[Callable[[int], torch.Tensor], str]] = {
    "sparse_coo": (lambda n: torch.eye(n).to_sparse(), r"is a tensor of layout sparse_coo, .*: \.to_dense\(\)$"),
    "sparse_csr": (lambda n: torch.eye(n).to_sparse_csr(), r"is a tensor of layout sparse_csr, .*: \.to_dense\(\)$"),
    "mkldnn": (_mkldnn, r"is a tensor of layout mkldnn, .*: \.to_dense\(\)$"),
    "meta": (lambda n: torch.empty(n, n, device="meta"), r"is a tensor on the meta device, .* materialise it"),
    "nested": (lambda n: torch.nested.nested_tensor([torch.ones(n, n), torch.ones(n - 1, n)]), NESTED),
    "nested_jagged": (
        lambda n: torch.nested.nested_tensor([torch.ones(n, n), torch.ones(n - 1, n)], layout=torch.jagged),
        NESTED,
    ),
}
if not torch.backends.mkldnn.is_available():  # pragma: no cover - builds without oneDNN
    MAKERS.pop("mkldnn")

#: Small (staged into the buffer in one copy) and large (a synchronous save's direct write).
SIDES = {"small": 2, "large": int((DIRECT_MIN_BYTES // 4) ** 0.5) + 8}


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("size", SIDES)
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("kind", MAKERS)
def test_an_unsupported_tensor_is_refused_before_anything_is_written(
    tmp_path: Path, kind: str, async_save: bool, size: str
) -> None:
    make, text = MAKERS[kind]
    n = SIDES[size]
    dense = torch.arange(float(n * n)).reshape(n, n)
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        before = _files(tmp_path)
        with pytest.raises(StateMismatchError, match=r"^save of step 1 on rank 0: state key 'model/x' " + text) as e:
            mgr.save(1, {"model": {"x": make(n), "y": dense}})
        assert "copy_" not in str(e.value) and e.value.__cause__ is None
        assert _files(tmp_path) == before and mgr.steps() == []
        # The manager stays usable; a cached plan of the same shape, dtype and device (which
        # skips planning) still gets the check.
        mgr.save(2, {"model": {"x": dense, "y": dense}}).wait()
        with pytest.raises(StateMismatchError, match=r"^save of step 3 on rank 0: state key 'model/x' " + text):
            mgr.save(3, {"model": {"x": make(n), "y": dense}})
        mgr.save(4, {"model": {"x": dense * 2, "y": dense}}).wait()
        assert mgr.steps() == [2, 4] and torch.equal(mgr.load(4)["model"]["x"], dense * 2)


def test_a_meta_model_and_its_optimizer_in_overlapped_staging_are_refused_on_the_callers_thread(
    tmp_path: Path,
) -> None:
    """Overlap defers the copy of optimizer-owned tensors to the background; tensors without
    data are never deferred, so the refusal still comes from ``save()`` itself."""
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        with pytest.raises(
            StateMismatchError,
            match=r"^save of step 1 on rank 0: state key 'model/(weight|bias)' is a tensor on the meta",
        ):
            mgr.save(1, {"model": model, "optim": opt})
        assert mgr.steps() == []


def test_complex_is_still_refused_by_its_dtype(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(
            StateMismatchError, match=r"^save of step \d+ on rank 0: state key 'z' has dtype complex64.*view_as_real"
        ):
            mgr.save(1, {"z": torch.zeros(2, dtype=torch.complex64)})
