"""Every use of a private Lightning attribute, in one place, checked against the tested releases.

The plugin needs the Trainer a LightningModule is attached to, or ``None`` (Lightning's public
``lm.trainer`` raises when there is none), and the importer parses ``configure_optimizers()``
outside a Trainer as the Trainer does (Lightning has no public function for that); the
loader of pointer files wraps the function Lightning reads ``.ckpt`` files with. Each
function below uses one private name (``checkpoint_loaders``: one function, by the names it
is imported as); each was checked on Lightning 2.5.6 and 2.6.6. The sampler Lightning puts
in a train DataLoader is resolved by a private method, which the plugin wraps
(``sampler_resolver``) to put its own there (:mod:`shardkeeper.lightning.data`).
``contract_check`` says which of them the installed Lightning has, and
``tests/lightning/test_internals.py`` asserts all of them, so a release that renames or
removes one fails loudly there (bump ``TESTED_RANGE`` only after that test passes on the new
release). ``warn_if_untested`` warns once per process outside the range.
"""

from __future__ import annotations

from typing import Any

from shardkeeper.core.adapter import VersionGate

#: Lightning releases whose internals this module was verified against: [low, high).
TESTED_RANGE = ((2, 5), (2, 7))


class LightningInternalsError(RuntimeError):
    """The installed Lightning does not have the internals this adapter relies on."""


#: The range check and the one warning outside it (``TESTED_RANGE``).
GATE = VersionGate(
    "shardkeeper.lightning", "Lightning", "lightning", TESTED_RANGE, "its internals are checked where they are used"
)


def version_tested() -> bool:
    return GATE.in_range()


def warn_if_untested() -> None:
    """Warn (once per process) when the installed Lightning is outside ``TESTED_RANGE``."""
    GATE.warn_if_untested(stacklevel=4)


def _missing(what: str) -> LightningInternalsError:
    import lightning

    return LightningInternalsError(
        f"Lightning {lightning.__version__} lacks {what}, which shardkeeper.lightning relies on; "
        f"this adapter was verified with Lightning {GATE.range_text()}. Install a Lightning release in "
        f"that range, or update shardkeeper-lightning"
    )


# -- the internals ----------------------------------------------------------------------------
def trainer_of(lm: Any) -> Any:
    """The Trainer ``lm`` (a LightningModule) is attached to, or ``None``: ``lm._trainer``
    (2.5.6, 2.6.6), behind the public ``lm.trainer`` that raises when it is unset."""
    try:
        return lm._trainer
    except AttributeError:
        raise _missing("LightningModule._trainer") from None


def parse_optimizers(conf: Any) -> list[Any]:
    """The optimizers of a ``configure_optimizers()`` return value, as the Trainer reads it:
    ``lightning.pytorch.core.optimizer._configure_optimizers`` (2.5.6, 2.6.6)."""
    from lightning.pytorch.core import optimizer

    parse = getattr(optimizer, "_configure_optimizers", None)
    if parse is None:
        raise _missing("lightning.pytorch.core.optimizer._configure_optimizers")
    opts, _, _ = parse(conf)
    return list(opts)


def checkpoint_loaders() -> list[tuple[Any, str]]:
    """Where Lightning loads a ``.ckpt`` file, as ``(module, name)``: the function
    ``lightning.fabric.utilities.cloud_io._load`` and its imports as ``pl_load`` in
    ``lightning.pytorch.core.saving`` (``load_from_checkpoint``) and
    ``lightning.fabric.plugins.io.torch_io`` (``TorchCheckpointIO``) (2.5.6, 2.6.6)."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    found = [(cloud_io, "_load"), (saving, "pl_load"), (torch_io, "pl_load")]
    for module, name in found:
        if not callable(getattr(module, name, None)):
            raise _missing(f"{module.__name__}.{name}")
    return found


def sampler_resolver() -> tuple[Any, str]:
    """Where Lightning resolves the sampler it puts in a DataLoader under
    ``use_distributed_sampler`` (its ``DistributedSampler`` for a train loader), as
    ``(class, method name)``: ``_DataConnector._resolve_sampler(self, dataloader, shuffle,
    mode)`` in ``lightning.pytorch.trainer.connectors.data_connector`` (2.5.6, 2.6.6)."""
    from lightning.pytorch.trainer.connectors import data_connector

    cls = getattr(data_connector, "_DataConnector", None)
    if cls is None or not callable(getattr(cls, "_resolve_sampler", None)):
        raise _missing("lightning.pytorch.trainer.connectors.data_connector._DataConnector._resolve_sampler")
    return cls, "_resolve_sampler"


# -- the contract -----------------------------------------------------------------------------
def contract_check() -> dict[str, bool]:
    """Each private name this adapter uses: whether the installed Lightning has it as expected."""
    import torch

    from lightning.pytorch import LightningModule
    from lightning.pytorch.core import optimizer

    present = {
        "LightningModule._trainer": False,
        "lightning.pytorch.core.optimizer._configure_optimizers": False,
        "the .ckpt loaders (cloud_io._load, saving.pl_load, torch_io.pl_load)": False,
        "_DataConnector._resolve_sampler": False,
    }
    try:
        present["_DataConnector._resolve_sampler"] = sampler_resolver()[1] == "_resolve_sampler"
    except LightningInternalsError:
        pass
    try:
        present["the .ckpt loaders (cloud_io._load, saving.pl_load, torch_io.pl_load)"] = len(checkpoint_loaders()) == 3
    except LightningInternalsError:
        pass
    try:
        present["LightningModule._trainer"] = trainer_of(LightningModule()) is None
    except LightningInternalsError:
        pass
    parse = getattr(optimizer, "_configure_optimizers", None)
    if callable(parse):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        try:
            present["lightning.pytorch.core.optimizer._configure_optimizers"] = parse_optimizers(opt) == [opt]
        except Exception:  # noqa: BLE001 - any failure means the signature changed
            pass
    return present


__all__ = [
    "TESTED_RANGE",
    "LightningInternalsError",
    "checkpoint_loaders",
    "contract_check",
    "parse_optimizers",
    "sampler_resolver",
    "trainer_of",
    "version_tested",
    "warn_if_untested",
]
