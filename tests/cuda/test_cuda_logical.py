"""Logical partials summed on the GPU (state/logical_torch.py) equal, bit for bit, the numpy
definition over the same bytes copied to the host: CUDA's int64 multiply and sum wrap as the
CPU's do and its float64 block sums are exact. The extra device memory stays bounded, and a
job that asks torch for deterministic algorithms gets the same sums."""

from __future__ import annotations

import math

import pytest
import torch

from shardkeeper.core.format import logical
from shardkeeper.core.state.logical_torch import CHUNK_BYTES, device_partial, device_partials

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    hi = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, hi, (math.prod(shape) * size,), generator=g, dtype=torch.uint8, device=device)
    return raw.view(dtype).reshape(shape)


def _host_sum(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    flat = torch.empty(local.numel(), dtype=local.dtype).copy_(local.reshape(-1))
    return logical.box_sum(flat.view(torch.uint8).numpy().data, local.element_size(), shape, offsets, local.shape)


def _shards(device: torch.device) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Whole tensors, row and column shards (aligned rows and rows at every phase), a 3-d box,
    strided views, one long run in many pieces, empty and 0-d tensors, small ones batched."""
    out: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []
    big = _random((4096, 4096), torch.bfloat16, device, 1)  # 32 MiB: several pieces
    out += [(big, (4096, 4096), (0, 0)), (big[1000:3000], (4096, 4096), (1000, 0))]
    out.append((big[:, 1024:3072], (4096, 4096), (0, 1024)))  # a column shard (non-contiguous)
    odd = _random((1001, 777), torch.float32, device, 2)
    out.append((odd[3:990, 5:700], (1001, 777), (3, 5)))  # rows at every phase
    cube = _random((50, 60, 70), torch.uint8, device, 3)
    out.append((cube[2:40, 1:59, 3:67], (50, 60, 70), (2, 1, 3)))
    for i, dt in enumerate([torch.float64, torch.int32, torch.float16, torch.int8, torch.bool, torch.float8_e4m3fn]):
        t = _random((3000, 300), dt, device, 10 + i)
        out.append((t[::2][:, 7:250], (1500, 300), (0, 7)))  # a strided view of a (1500, 300) tensor
    long = _random(((3 << 22) + 5,), torch.int64, device, 4)  # 96 MiB + 40 bytes, odd phase
    out.append((long[5:], ((3 << 22) + 5,), (5,)))
    out += [(torch.empty(0, 8, device=device), (4, 8), (4, 0)), (torch.tensor(1.5, device=device), (), ())]
    out += [(_random((64 + i,), torch.float32, device, 100 + i), (64 + i,), (0,)) for i in range(300)]
    return out


def test_device_partials_equal_the_host_definition(device: torch.device) -> None:
    shards = _shards(device)
    got = device_partials(shards)
    assert got == [_host_sum(t.cpu(), s, o) for t, s, o in shards]


def test_deterministic_algorithms_give_the_same_sums(device: torch.device) -> None:
    every = _shards(device)
    shards = every[3:6] + every[-20:]
    before = device_partials(shards)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert device_partials(shards) == before
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_extra_device_memory_stays_bounded(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("measures the CUDA allocator; nothing to measure on CPU")
    t = _random((1 << 28,), torch.bfloat16, device, 5)  # 512 MiB
    col = _random((8192, 8192), torch.float32, device, 6)[:, 100:4000]  # 122 MiB, non-contiguous
    for shard, shape, offsets in [(t, (1 << 28,), (0,)), (col, (8192, 8192), (0, 100))]:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        device_partial(shard, shape, offsets)
        extra = torch.cuda.max_memory_allocated(device) - base
        assert extra <= 10 * CHUNK_BYTES, f"{extra / 2**20:.1f} MiB of extra device memory"


def test_the_public_digests_of_device_tensors_are_the_hosts(device: torch.device) -> None:
    """``logical_digest`` and ``logical_partial`` of a tensor on the device (the restore's
    check of CUDA targets sums them there) equal those of its host copy."""
    from shardkeeper.core import logical_digest, logical_partial

    t = _random((1001, 777), torch.bfloat16, device, 5)
    assert logical_digest(t) == logical_digest(t.cpu())
    part = logical_partial(t[10:500, 3:600], (10, 3), (1001, 777))
    assert part == logical_partial(t[10:500, 3:600].cpu(), (10, 3), (1001, 777))
