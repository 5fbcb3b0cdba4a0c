"""Every private torch API the core uses (all in ``state/_torch_compat.py``) still exists and
still behaves as the core assumes. A torch upgrade that moves one fails here, by name."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from shardkeeper.core.state import _torch_compat as tc

# (module, name): every torch symbol _torch_compat imports, private or from a private module.
SYMBOLS = [
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
    ("torch.distributed.tensor._utils", "_get_shard_size_and_offsets"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch", "_foreach_zero_"),
    ("torch", "_foreach_copy_"),
    ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
]


@pytest.mark.parametrize("module,name", SYMBOLS, ids=[f"{m}.{n}" for m, n in SYMBOLS])
def test_symbol_exists(module: str, name: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"torch {torch.__version__}: module {module} is gone ({e}); update _torch_compat")
    assert hasattr(mod, name), f"torch {torch.__version__}: {module}.{name} is gone; update _torch_compat"


def test_compat_module_resolved_the_optional_symbols() -> None:
    # The try/except imports in _torch_compat must not have fallen back to None on this torch.
    assert tc._StridedShard is not None, "_StridedShard fell back to None"
    assert tc.ShardedTensor is not None, "ShardedTensor fell back to None"


def test_world_has_pg_map() -> None:
    from torch.distributed.distributed_c10d import _world

    assert hasattr(type(_world), "pg_map") or hasattr(_world, "pg_map"), "_world.pg_map is gone"
    assert isinstance(_world.pg_map, dict)


def test_get_shard_size_and_offsets_signature() -> None:
    # _torch_compat.shard_dim_indices calls it positionally with 7 arguments, in this order.
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    params = list(inspect.signature(_get_shard_size_and_offsets).parameters)
    assert params[:7] == [
        "curr_local_size",
        "mesh_dim_size",
        "rank",
        "placement",
        "previous_offsets",
        "zero_global_offset",
        "skip_offset",
    ], params


def test_shard_dim_indices_even_uneven_strided_and_composed() -> None:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    # torch.chunk semantics: 10 rows over 3 ranks -> 4, 4, 2
    got = [tc.shard_dim_indices(10, 3, r, Shard(0), None) for r in range(3)]
    assert [n for n, _ in got] == [4, 4, 2]
    assert [i.tolist() for _, i in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # more ranks than rows: the last ones are empty
    n, idx = tc.shard_dim_indices(2, 4, 3, Shard(0), None)
    assert n == 0 and idx.numel() == 0
    # a second mesh dim shards the rows the first one gave this rank
    n, idx = tc.shard_dim_indices(4, 2, 1, Shard(0), torch.tensor([4, 5, 6, 7]))
    assert n == 2 and idx.tolist() == [6, 7]
    # _StridedShard (FSDP2 + TP): rank r holds every split_factor-th block
    got = [tc.shard_dim_indices(4, 2, r, _StridedShard(0, split_factor=2), None) for r in range(2)]
    assert [i.tolist() for _, i in got] == [[0, 2], [1, 3]]


def test_tensor_privates_behave_as_staging_and_restore_assume() -> None:
    """The version counter grows with each in-place change (overlapped staging's torn-copy
    check), a zero tensor is told apart (restore never reads into one), and the batched copy
    and zeroing do what one ``copy_`` / ``zero_`` per tensor would."""
    t = torch.zeros(4)
    before = tc.version(t)
    t.add_(1)
    assert tc.version(t) == before + 1
    t[1:3].mul_(2)  # a view shares the counter
    assert tc.version(t) == before + 2
    assert not tc.is_zero_tensor(t) and tc.is_zero_tensor(torch._efficientzerotensor(3))
    dsts, srcs = [torch.empty(2), torch.empty(3, dtype=torch.float64)], [torch.ones(2), torch.arange(3.0)]
    tc.copy_all(dsts, srcs)
    assert dsts[0].tolist() == [1.0, 1.0] and dsts[1].tolist() == [0.0, 1.0, 2.0]
    tc.zero_all(dsts)
    assert all(not d.any() for d in dsts)


def test_placement_predicates() -> None:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    assert tc.is_shard_placement(Shard(1)) and tc.is_shard_placement(_StridedShard(0, split_factor=2))
    assert not tc.is_shard_placement(Replicate()) and not tc.is_shard_placement(Partial())
    assert tc.is_replicate(Replicate()) and not tc.is_replicate(Shard(0))
    assert tc.is_partial(Partial()) and not tc.is_partial(Replicate())
    assert not tc.is_dtensor(torch.ones(2)) and not tc.is_sharded_tensor(torch.ones(2))


def test_stores_and_dtensor_in_a_one_rank_group(tmp_path) -> None:
    """``default_store`` / ``group_store`` and DTensor detection on a real (1-rank) group, in a
    subprocess so that this test process never holds a process group."""
    code = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
        from shardkeeper.core.state import _torch_compat as tc
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        try:
            s = tc.default_store()
            s.set("k", "v")
            assert s.get("k") == b"v"
            assert tc.group_store(None).get("k") == b"v"
            g = dist.new_group([0])
            gs = tc.group_store(g)
            gs.set("k2", "w")
            assert gs.get("k2") == b"w"
            mesh = init_device_mesh("cpu", (1,))
            dt = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
            assert tc.is_dtensor(dt) and tc.is_shard_placement(dt.placements[0])
            assert isinstance(getattr(dt, "_local_tensor", None), torch.Tensor)  # local_shape's fast path
            local = tc.local_tensor(dt)
            assert local.data_ptr() == dt.to_local().data_ptr() and local.shape == (3, 2)
            assert tc.local_shape(dt) == dt.to_local().shape == (3, 2)
            p = DTensor.from_local(torch.ones(2), mesh, [Partial()])
            assert tc.is_partial(p.placements[0])
            # FSDP1's ShardedTensors: the process group their placements name ranks of
            import torch.distributed._shard.sharded_tensor as sharded
            from torch.distributed._shard.sharding_spec import ChunkShardingSpec
            st = sharded.empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4, 2)
            assert tc.is_sharded_tensor(st) and hasattr(st, "_process_group")
            assert tc.sharded_tensor_group_size(st) == 1 and tc.sharded_tensor_rank(st) == 0
            assert tc.sharded_tensor_group_size(torch.ones(2)) == -1
            # a DeviceMesh's slice knows the mesh it came from, and its dimensions there by name
            m2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
            sub = m2["tp"]
            assert tc.root_mesh(sub) is m2 and tc.root_mesh(m2) is m2 and sub.ndim < m2.ndim
            assert tc.submesh_dims(sub, m2) == (1,) and tc.submesh_dims(mesh, mesh) is None
        finally:
            dist.destroy_process_group()
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
