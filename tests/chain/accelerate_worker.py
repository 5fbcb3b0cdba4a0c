"""Hop 4: ``Accelerator(cpu=True)`` (world size 2) with the shardkeeper plugin
(``shardkeeper.accelerate.enable(accelerator, root)``, docs/accelerate.md): ``load_state()``
from the root, train 2 steps (inside ``accelerator.accumulate``, which counts
``accelerator.step``), ``save_state()``: it numbers saves (the save iteration), so it lands at
the step loaded + 1.

    accelerate_worker.py ROOT OUT
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import shardkeeper.accelerate as ska  # noqa: E402
from tests.chain.common import Hop, Net, adam, committed_steps, loss_of, record, run_hop  # noqa: E402

STEPS = 2


def acc_record(acc: Accelerator, model, opt) -> dict[str, torch.Tensor]:
    params = dict(acc.unwrap_model(model).named_parameters())
    inner = getattr(opt, "optimizer", opt)
    return record(params, {n: inner.state.get(p, {}) for n, p in params.items()})


def run(hop: Hop, root: str) -> None:
    acc = Accelerator(cpu=True)
    hop.check(
        "Accelerate runs MULTI_CPU on every rank",
        str(acc.distributed_type.value) == "MULTI_CPU",
        str(acc.distributed_type),
    )
    ska.enable(acc, root)
    torch.manual_seed(100 + hop.index)
    model = Net()
    model, opt = acc.prepare(model, adam(model.parameters()))
    step = acc.load_state()  # the newest committed step under the root; returns it
    hop.loaded(step, acc_record(acc, model, opt))
    iteration = acc.project_configuration.iteration  # the step the next save_state() gets
    hop.counter("accelerator.step", acc.step, step, f"; project_configuration.iteration = {iteration}")
    for k in range(STEPS):
        with acc.accumulate(model):
            acc.backward(loss_of(model, step + k, hop.rank))
            opt.step()
            opt.zero_grad()
    before = committed_steps(root)
    acc.save_state()
    ska.wait(acc)
    # save_state() numbers saves (Accelerate's save iteration), which continues from the step loaded
    hop.counter("project_configuration.iteration - 1", iteration - 1, step)
    hop.saved(
        before,
        committed_steps(root),
        step + 1,
        acc_record(acc, model, opt),
        f"save_state() at accelerator.step = {acc.step}, iteration after load {iteration}",
    )
    acc.end_training()


if __name__ == "__main__":
    run_hop("accelerate", run)
