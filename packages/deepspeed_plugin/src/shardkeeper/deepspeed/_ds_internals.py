"""Every use of a private DeepSpeed (or torch) attribute, in one place, checked against the tested releases.

DeepSpeed's public tensor-fragment API (``safe_get_local_fp32_param`` ...) covers ZeRO-3 local
partitions but not ZeRO-1/2, and none of it says where a rank's partition lies in the global
parameter, restores lazily created optimizer state, or pushes fp32 master weights back into
the low-precision parameters. Those need the optimizer's internals, listed below; the
functions here were checked on DeepSpeed 0.18.9 and 0.19.8 (torch 2.13).
``contract_check`` / ``check_engine`` verify all of them on a live engine; ``tests/deepspeed``
runs it on every stage, so a DeepSpeed release that renames or reshapes any of them fails
loudly there (bump ``TESTED_RANGE`` only after that test passes on the new release).
``warn_if_untested`` warns once per process when the installed release is outside the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardkeeper.core.adapter import VersionGate

#: DeepSpeed releases whose internals this module was verified against: [low, high).
TESTED_RANGE = ((0, 16), (0, 20))

#: Per ZeRO stage, the optimizer attributes used here (checked by ``check_engine``).
ZERO12_ATTRS = (
    "bit16_groups",
    "single_partition_of_fp32_groups",
    "optimizer",
    "update_lp_params",
    "_hp_optimizer_states_linked",
)
ZERO3_ATTRS = (
    "fp16_groups",
    "fp32_partitioned_groups_flat",
    "fp16_partitioned_groups_flat",
    "sub_group_to_group_id",
    "grad_position",
    "get_param_id",
    "optimizer",
    "_reassign_or_swap_out_partitioned_parameters",
    "persistent_parameters",
)
MAPPING_ATTRS = ("lp_fragment_address", "hp_fragment_address", "set_optim_state_fragment")


class DeepSpeedInternalsError(RuntimeError):
    """The installed DeepSpeed does not have the internals this adapter relies on."""


#: The range check and the one warning outside it (``TESTED_RANGE``).
GATE = VersionGate("shardkeeper.deepspeed", "DeepSpeed", "deepspeed", TESTED_RANGE, "its internals passed the checks")


def version_tested() -> bool:
    return GATE.in_range()


def warn_if_untested() -> None:
    """Warn (once per process) when the installed DeepSpeed is outside ``TESTED_RANGE``."""
    GATE.warn_if_untested(stacklevel=4)


def _missing(obj: Any, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def zero_optimizer(engine: Any) -> Any:
    """The ZeRO optimizer wrapper (``engine.optimizer``), after checking the stage is supported."""
    stage = zero_stage(engine)
    if stage not in (1, 2, 3):
        raise DeepSpeedInternalsError(
            f"shardkeeper.deepspeed supports ZeRO stages 1, 2 and 3; this engine runs stage "
            f"{stage}. Enable zero_optimization.stage >= 1 in the DeepSpeed config"
        )
    return engine.optimizer


def contract_check(engine: Any) -> dict[str, bool]:
    """Each private attribute this adapter needs, by name: whether ``engine`` (and torch) has it."""
    opt = zero_optimizer(engine)
    present = {n: hasattr(opt, n) for n in (ZERO3_ATTRS if zero_stage(engine) == 3 else ZERO12_ATTRS)}
    if zero_stage(engine) != 3:
        for group in getattr(opt, "bit16_groups", []):
            for p in group:
                has = hasattr(p, "_hp_mapping")
                present["param._hp_mapping"] = present.get("param._hp_mapping", True) and has
                if has and p._hp_mapping is not None:
                    for n in MAPPING_ATTRS:
                        key = f"_hp_mapping.{n}"
                        present[key] = present.get(key, True) and hasattr(p._hp_mapping, n)
    else:
        for group in getattr(opt, "fp16_groups", []):
            for p in group:
                for n in ("ds_tensor", "ds_shape", "ds_numel"):
                    present[f"param.{n}"] = present.get(f"param.{n}", True) and hasattr(p, n)
    from deepspeed.utils import mixed_precision_linkage

    present["deepspeed.utils.mixed_precision_linkage.lazy_init_hp_params_optimizer_state"] = hasattr(
        mixed_precision_linkage, "lazy_init_hp_params_optimizer_state"
    )
    present["torch.nn.Module._non_persistent_buffers_set"] = _non_persistent_set_works()
    return present


def check_engine(engine: Any) -> list[str]:
    """Names of the private attributes this adapter needs that ``engine`` lacks (empty = fine)."""
    return sorted(n for n, ok in contract_check(engine).items() if not ok)


def require_engine(engine: Any) -> None:
    missing = check_engine(engine)
    if missing:
        import deepspeed

        raise DeepSpeedInternalsError(
            f"DeepSpeed {deepspeed.__version__} lacks internals shardkeeper.deepspeed relies on: "
            f"{', '.join(missing)}; this adapter was verified with DeepSpeed "
            f"{GATE.range_text()}. "
            f"Install a DeepSpeed release in that range, or update shardkeeper-deepspeed"
        )


# -- where each rank's master weights and moments lie ---------------------------------------
@dataclass
class FlatGroup:
    """One flat fp32 partition the base optimizer steps, and the parameters it covers."""

    flat: torch.Tensor  # this rank's fp32 partition (a torch optimizer parameter)
    group_index: int  # index into the base optimizer's param_groups
    params: list[Any]  # the engine's parameters (with DeepSpeed's attributes attached)


@dataclass
class ParamSlice:
    """This rank's piece of one parameter: flat elements [offset, offset+numel) of the global
    parameter live at ``flat[start : start + numel]``."""

    param: Any
    shape: tuple[int, ...]
    flat_group: int  # index into the FlatGroup list
    start: int
    offset: int
    numel: int
    #: ``(pos, part)``: the parameter's place in the flat buffer whose consecutive parts of
    #: ``part`` elements the ranks of the world hold in rank order (``Fragment.partition``);
    #: None where the partitioning is not that (a data-parallel group other than the world).
    partition: tuple[int, int] | None = None


def _partition_rank(opt: Any, p: Any) -> int:
    """This rank's index among the ranks a ZeRO-3 parameter is partitioned over."""
    rank_of = getattr(opt, "_get_param_partition_rank", None)  # 0.19+: knows ZeRO++ groups
    if rank_of is not None:
        return int(rank_of(p))
    return int(torch.distributed.get_rank(group=p.ds_process_group))


def _whole_world(group: Any) -> bool:
    """Whether ``group``'s ranks are the world's, in rank order: a partition's parts are then
    held by the global ranks of the same numbers."""
    dist = torch.distributed
    if not dist.is_initialized():
        return False
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return list(ranks) == list(range(dist.get_world_size()))


def _zero12_partitions(opt: Any, i: int) -> dict[int, tuple[int, int]]:
    """ZeRO-1/2: each parameter of group ``i`` (by id) -> (its offset in the group's flat
    buffer, the partition size), from the optimizer's own bookkeeping; {} where it has none
    (an older release) or the group's data-parallel ranks are not the world's."""
    groups = getattr(opt, "round_robin_bit16_groups", None)
    offsets = getattr(opt, "round_robin_bit16_offsets", None)
    sizes = getattr(opt, "partition_size", None)
    dp = getattr(opt, "real_dp_process_group", None)
    if not (groups and offsets and sizes and dp) or i >= min(len(groups), len(offsets), len(sizes), len(dp)):
        return {}
    if not _whole_world(dp[i]) or len(groups[i]) != len(offsets[i]):
        return {}
    return {id(p): (int(off), int(sizes[i])) for p, off in zip(groups[i], offsets[i])}


def flat_groups(engine: Any) -> list[FlatGroup]:
    opt = zero_optimizer(engine)
    if zero_stage(engine) == 3:
        return [
            FlatGroup(flat, int(opt.sub_group_to_group_id[i]), list(opt.fp16_groups[i]))
            for i, flat in enumerate(opt.fp32_partitioned_groups_flat)
        ]
    return [FlatGroup(flat, i, list(opt.bit16_groups[i])) for i, flat in enumerate(opt.single_partition_of_fp32_groups)]


def param_slices(engine: Any, groups: list[FlatGroup]) -> list[ParamSlice]:
    """Every trainable parameter's slice on this rank (numel 0 where this rank holds none)."""
    opt = zero_optimizer(engine)
    out = []
    for gi, g in enumerate(groups):
        p: Any
        places = _zero12_partitions(opt, g.group_index) if zero_stage(engine) != 3 else {}
        for p in g.params:
            if zero_stage(engine) == 3:
                shape = tuple(int(s) for s in p.ds_shape)
                _, start, part = opt.grad_position[opt.get_param_id(p)]
                offset = _partition_rank(opt, p) * int(part)
                numel = max(0, min(int(part), int(p.ds_numel) - offset))
                partition = (0, int(part)) if _whole_world(p.ds_process_group) else None
                out.append(ParamSlice(p, shape, gi, int(start), min(offset, int(p.ds_numel)), numel, partition))
            else:
                shape = tuple(p.shape)
                hm = p._hp_mapping
                if hm is None:
                    out.append(ParamSlice(p, shape, gi, 0, 0, 0, places.get(id(p))))
                else:
                    out.append(
                        ParamSlice(
                            p,
                            shape,
                            gi,
                            int(hm.hp_fragment_address.start),
                            int(hm.lp_fragment_address.start),
                            int(hm.lp_fragment_address.numel),
                            places.get(id(p)),
                        )
                    )
    return out


def frozen_zero3_partitions(engine: Any) -> list[tuple[str, Any, int, int]]:
    """ZeRO-3 parameters the optimizer does not own: (name, param, offset, numel) of ds_tensor."""
    out = []
    owned = {id(p) for g in flat_groups(engine) for p in g.params}
    for name, p in engine.module.named_parameters():
        if id(p) in owned or not hasattr(p, "ds_tensor"):
            continue
        part = int(p.ds_tensor.numel())
        rank = torch.distributed.get_rank(group=p.ds_process_group) if torch.distributed.is_initialized() else 0
        offset = min(rank * part, int(p.ds_numel))
        out.append((name, p, offset, max(0, min(part, int(p.ds_numel) - offset))))
    return out


# -- after a restore ------------------------------------------------------------------------
def push_master_weights(engine: Any) -> None:
    """Copy the (restored) fp32 master partitions into the low-precision parameters (a collective)."""
    opt = zero_optimizer(engine)
    with torch.no_grad():
        if zero_stage(engine) == 3:
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)
            # Small parameters stay gathered between steps (stage3_param_persistence_threshold):
            # re-gather them from the new partitions, as DeepSpeed does after each step.
            if opt.persistent_parameters:
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
        else:
            opt.update_lp_params()


def regather_zero3(engine: Any, params: list[Any]) -> None:
    """Re-gather persistent ZeRO-3 parameters whose ds_tensor was written directly."""
    persistent = [p for p in params if p in set(zero_optimizer(engine).persistent_parameters)]
    if persistent:
        persistent[0].all_gather(persistent)


def relink_optimizer_fragments(engine: Any) -> None:
    """ZeRO-1/2: point every ``_hp_mapping.optim_fragment`` at the current optimizer state.

    DeepSpeed links them lazily at its next step; until then (and after its own
    ``load_checkpoint`` on 0.19.8) ``safe_get_full_optimizer_state`` fails. Relinking makes
    the public fragment API consistent right after a restore.
    """
    if zero_stage(engine) == 3:
        return
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    opt = zero_optimizer(engine)
    for i, flat in enumerate(opt.single_partition_of_fp32_groups):
        if flat in opt.optimizer.state:
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[i], flat, opt.optimizer.state)
    opt._hp_optimizer_states_linked = True


# -- torch ------------------------------------------------------------------------------
def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` would hold (persistent ones, of every submodule), by
    their dotted names, without calling ``state_dict``: that would run the model's state-dict
    hooks and overrides (and, under ZeRO-3, see partitioned parameters), and ``named_buffers``
    lists non-persistent buffers too. Torch marks those only in the private
    ``_non_persistent_buffers_set`` of their module (checked on torch 2.13)."""
    out = {}
    for mname, mod in module.named_modules():
        skip = mod._non_persistent_buffers_set
        for bname, buf in mod.named_buffers(recurse=False, remove_duplicate=False):
            if bname not in skip:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def _non_persistent_set_works() -> bool:
    """Whether torch still records non-persistent buffers where ``persistent_buffers`` reads them."""
    probe = torch.nn.Module()
    probe.register_buffer("kept", torch.zeros(1))
    probe.register_buffer("dropped", torch.zeros(1), persistent=False)
    try:
        return list(persistent_buffers(probe)) == list(probe.state_dict()) == ["kept"]
    except AttributeError:
        return False


# -- configuration ------------------------------------------------------------------------
def config_dict(engine: Any) -> dict[str, Any]:
    """The DeepSpeed config as parsed by DeepSpeed (a dict even when given as a file path)."""
    parsed = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(parsed, dict):
        return parsed
    return engine.config if isinstance(getattr(engine, "config", None), dict) else {}


# -- loss scaler ----------------------------------------------------------------------------
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(engine: Any) -> dict[str, Any]:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return {}
    out: dict[str, Any] = {}
    for name in SCALER_FIELDS:
        if hasattr(scaler, name):
            v = getattr(scaler, name)
            out[name] = float(v) if isinstance(v, (float, torch.Tensor)) else v
    return out


def set_loss_scaler_state(engine: Any, state: dict[str, Any]) -> None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return
    for name, v in state.items():
        if name in SCALER_FIELDS and hasattr(scaler, name):
            cur = getattr(scaler, name)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            else:
                setattr(scaler, name, v)  # JSON keeps int vs float, as DeepSpeed had it


__all__ = [
    "TESTED_RANGE",
    "DeepSpeedInternalsError",
    "FlatGroup",
    "ParamSlice",
    "check_engine",
    "contract_check",
    "flat_groups",
    "frozen_zero3_partitions",
    "loss_scaler_state",
    "param_slices",
    "persistent_buffers",
    "push_master_weights",
    "relink_optimizer_fragments",
    "require_engine",
    "set_loss_scaler_state",
    "version_tested",
    "warn_if_untested",
    "zero_stage",
]
