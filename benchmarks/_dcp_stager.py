"""A DCP ``DefaultStager`` that a benchmark can reuse over many ``dcp.async_save`` calls, on
every torch that has one.

On torch 2.11 (2.11.0+cu130 seen) a ``DefaultStager`` stages once: its second ``stage()``
fails with ``KeyError: <class 'type'>``, its copy table (``_deepcopy_dispatch``, which its
``close()`` clears to break reference cycles) found empty. torch 2.13 stages any number of
times. This stager keeps a copy of that table and puts it back before a ``stage()`` that
would meet it empty, counting each time in ``refills`` (a benchmark reports it); its pinned
buffers stay as torch left them. The benchmark calls ``close_now()`` after its last save.
This reaches into torch's private attributes on purpose: it measures DCP's intended reuse
on a torch whose reuse is broken, and does nothing where it is not.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.staging import DefaultStager


class ReusableStager(DefaultStager):  # type: ignore[misc]
    """A ``DefaultStager`` whose copy table survives each save, closed only by ``close_now()``."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.refills = 0
        self._table = dict(self._copy_table())

    def _copy_table(self) -> dict[Any, Any]:
        return self._state_dict_stager._deepcopy_dispatch  # type: ignore[no-any-return]

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        table = self._copy_table()
        if self._table and not table:
            table.update(self._table)
            self.refills += 1
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        """Ignored: the benchmark reuses the stager; ``close_now()`` closes it."""

    def close_now(self) -> None:
        self._table.clear()
        super().close()
