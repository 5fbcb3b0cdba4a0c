"""Which copy of a replicated tensor a rank holds, numbered over the saving world: the save's
choice of the copy that writes (save/plan.py) and its comparison of the others with it
(save/replicas.py) both number copies here.

A plain tensor has a copy per rank (DDP); a DTensor one per combination of coordinates along
its ``Replicate`` mesh dimensions. A DTensor on a submesh of a named mesh over the whole world
(FSDP2 over the data-parallel dimension of a 2-D world) also has a copy per coordinate along
the dimensions its submesh leaves out, which its mesh does not name: they are numbered as the
whole mesh's ``Replicate`` dimensions, as its described rule records them (save/describe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import LocalLayout


@dataclass(frozen=True)
class Copy:
    """How many copies of a tensor the world holds, and which of them this rank's pieces are
    part of (row-major over the replicating coordinates)."""

    copies: int
    index: int


def copy_of(t: torch.Tensor, layout: LocalLayout, world_size: int) -> Copy | None:
    """The copy of ``t`` (``layout``: this rank's view of it) this rank holds, or None where
    the world's copies are not known: a DTensor whose mesh is not the whole world and is no
    slice, by names, of a mesh that is (a flattened dimension's mesh, a subgroup's)."""
    if not tc.is_dtensor(t):
        return Copy(layout.replicas, layout.replica_index)
    dm = t.device_mesh
    if dm.size() == world_size:
        return Copy(layout.replicas, layout.replica_index)
    root = tc.root_mesh(dm)
    dims = tc.submesh_dims(dm, root) if root is not dm else None
    if dims is None or root.size() != world_size or not tc.is_whole_world(world_size):
        return None  # (a mesh's ranks are distinct global ranks: of the world's size, they are all)
    coord = root.get_coordinate()
    if coord is None:
        return None
    named = dict(zip(dims, t.placements))
    copies, index = 1, 0
    for m, size in enumerate(root.shape):
        if m not in named or tc.is_replicate(named[m]):
            copies, index = copies * size, index * size + coord[m]
    return Copy(copies, index)


__all__ = ["Copy", "copy_of"]
