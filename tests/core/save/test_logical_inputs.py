"""``logical_digest``, ``logical_partial`` and ``logical_combine`` refuse what they cannot
digest with an error saying what to pass instead: a tensor with no row-major elements (meta,
sparse COO/CSR, nested), where torch's own error would not say what is wrong; a plain shard's
place that is not one int per dimension; and what is not a list of partials."""

from __future__ import annotations

import warnings

import pytest
import torch

from shardkeeper.core import logical_combine, logical_digest, logical_partial


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


@pytest.mark.parametrize(
    ("offsets", "global_shape", "said"),
    [
        ((0.5, 0), (2, 3), "offsets.*float 0.5"),
        ((True, 0), (2, 3), "offsets.*bool True"),
        (("1", 0), (2, 3), "offsets.*str '1'"),
        ((1, 0), (2.9, 3), "global_shape.*float 2.9"),
        ((1, 0), 6, "global_shape.*int"),
    ],
)
def test_logical_partial_refuses_places_that_are_not_ints(offsets: object, global_shape: object, said: str) -> None:
    """A non-integral offset or size was truncated by int() into another box's partial."""
    with pytest.raises(TypeError, match=f"logical_partial: {said}"):
        logical_partial(torch.ones(1, 3), offsets, global_shape)  # type: ignore[arg-type]


def test_logical_partial_names_a_place_of_the_wrong_rank() -> None:
    """Offsets or a global shape with another number of dimensions than the shard's are
    named as such, not as a box outside the tensor."""
    with pytest.raises(ValueError, match=r"logical_partial: offsets \[0\] .*1 dimension.*2-d shard"):
        logical_partial(torch.ones(1, 3), [0], [2, 3])
    with pytest.raises(ValueError, match=r"logical_partial: global_shape \[6\] .*1 dimension.*2-d shard"):
        logical_partial(torch.ones(1, 3), [0, 0], [6])


def test_logical_combine_refuses_what_is_not_a_list_of_partials() -> None:
    """A digest string or a lone partial in place of a list of partials is a TypeError
    saying what to pass, not an AttributeError from inside."""
    part = logical_partial(torch.ones(2), [0], [2])
    with pytest.raises(TypeError, match=r"logical_combine\(\) takes LogicalPartial.*got a str"):
        logical_combine([part, logical_digest(torch.ones(2))])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"logical_combine\(\) takes an iterable of LogicalPartial.*\[partial\]"):
        logical_combine(part)  # type: ignore[arg-type]
    assert logical_combine([part]) == logical_digest(torch.ones(2))


def test_a_nested_tensor_is_refused_clearly() -> None:
    """A strided nested tensor has torch.strided layout, and torch's own error for its shape
    is an internal one ("NestedTensorImpl doesn't support sizes")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: nested tensors are a prototype)
        nested = [
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        ]
    for t in nested:
        with pytest.raises(TypeError, match=r"logical_digest: a nested tensor .*unbind\(\)"):
            logical_digest(t)
        with pytest.raises(TypeError, match=r"logical_partial: a nested tensor .*unbind\(\)"):
            logical_partial(t, [0], [2])
