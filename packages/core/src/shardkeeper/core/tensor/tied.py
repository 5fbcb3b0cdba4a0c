"""Tied weights on restore: a target key the checkpoint lacks is no missing key when the
module holds that tensor under another name the checkpoint has.

A module's ``state_dict()`` lists a tied weight under every name it has (GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``), while a save that walks
``named_parameters()`` (DeepSpeed's engine state, for one) holds it under one name. Restoring
the twin fills the alias too, since they are one tensor; so a strict restore of such a
checkpoint into the module must not fail on the alias. The groups come from the module
(``state.module_ties``), never from where a tensor's memory lies: every rank decides alike,
a DTensor's empty shard included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def tied_aliases(ties: Sequence[tuple[str, ...]], missing: Iterable[str], restored: Iterable[str]) -> dict[str, str]:
    """Each of ``missing`` that is tied to a restored key, mapped to that key."""
    done = set(restored)
    out: dict[str, str] = {}
    for group in ties:
        twin = next((k for k in group if k in done), None)
        if twin is None:
            continue
        for key in group:
            if key not in done:
                out[key] = twin
    return {k: out[k] for k in missing if k in out}


__all__ = ["tied_aliases"]
