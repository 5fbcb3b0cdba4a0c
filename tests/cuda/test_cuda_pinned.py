"""The staging buffer of CUDA sources: pinned at its exact size, on the sources' own devices.

torch's pinned allocator rounds every request up to a power of two (a 4 GiB + 1 page buffer
would pin 8 GiB); the stager registers memory of the exact size instead
(``save/pinned.py``). And the copies, events and synchronisation of staging follow the
device each source is on, not the thread's current device (a background thread starts on
device 0; a rank's tensors are on its own GPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.checks import assert_same_state, state_of

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


def _needs_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("checks CUDA pinning and device placement; nothing to check on CPU")


def _pinned_allocator_bytes() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    value = None if stats is None else stats().get("allocated_bytes.current")  # the host allocator's name
    return None if value is None else int(value)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_staging_buffer_is_pinned_at_its_exact_size(tmp_path: Path, device: torch.device, writer: str) -> None:
    """With ``writer="process"`` the buffer is shared memory, registered as pinned in place."""
    _needs_cuda(device)
    # 17 MiB of sources: the power-of-two allocator would pin 32 MiB.
    state = {"w": torch.randn(17 << 18, device=device)}  # float32: 17 MiB
    before = _pinned_allocator_bytes()
    with CheckpointManager(tmp_path, async_save=True, writer=writer) as mgr:
        mgr.save(1, state).wait()
        st = mgr._stager
        buf = st._buffer
        assert buf is not None and buf.is_pinned(), st.pinned_how
        assert st.pinned_how in (("registered", "allocator") if writer == "thread" else ("registered",))
        if st.pinned_how == "registered":
            assert buf.numel() < (18 << 20), buf.numel()
            if before is not None:
                assert _pinned_allocator_bytes() == before  # nothing went through the rounding allocator
        got = {"w": torch.empty_like(state["w"])}
        mgr.restore(got, step=1)
    assert_same_state(got, state)


def test_sources_on_another_device_than_the_current_one(tmp_path: Path, device: torch.device) -> None:
    """Sources on cuda:1 while the caller's current device is cuda:0: staging must wait for
    cuda:1's copies, and the deferred copy (a background thread, which starts on device 0)
    must run and wait on cuda:1."""
    _needs_cuda(device)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    other = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512)).to(other)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(64, 512, device=other)
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    want = state_of(model, opt)
    for staging in ("blocking", "overlap"):
        with CheckpointManager(tmp_path / staging, staging=staging) as mgr:
            mgr.save(1, {"model": model, "optim": opt}).wait()
            model2 = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512)).to(other)
            opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
            model2(x).pow(2).mean().backward()
            opt2.step()
            mgr.restore({"model": model2, "optim": opt2}, step=1)
            assert_same_state(state_of(model2, opt2), want)
