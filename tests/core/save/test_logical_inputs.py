"""``logical_digest`` and ``logical_partial`` refuse, with a TypeError saying what to pass
instead, a tensor with no row-major elements: a meta tensor (no data) and sparse tensors
(COO, CSR); torch's own error (a NotImplementedError, a RuntimeError about memory formats)
would not say what is wrong."""

from __future__ import annotations

import warnings

import pytest
import torch

from shardkeeper.core import logical_digest, logical_partial


def _inputs() -> list[tuple[torch.Tensor, str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: sparse CSR support is in beta)
        return [
            (torch.empty(3, 4, device="meta"), "a meta tensor .* holds no elements.*materialize it first"),
            (torch.eye(3).to_sparse(), "a sparse_coo tensor has no row-major elements.*to_dense()"),
            (torch.eye(3).to_sparse_csr(), "a sparse_csr tensor has no row-major elements.*to_dense()"),
        ]


@pytest.mark.parametrize("case", range(3))
def test_meta_and_sparse_tensors_are_refused_clearly(case: int) -> None:
    t, said = _inputs()[case]
    with pytest.raises(TypeError, match=f"logical_digest: {said}"):
        logical_digest(t)
    with pytest.raises(TypeError, match=f"logical_partial: {said}"):
        logical_partial(t, (0,) * t.dim(), t.shape)
    assert logical_digest(torch.eye(3)) == logical_digest(torch.eye(3).to_sparse().to_dense())
