"""One process (a world of one on gloo/CPU): Accelerate with DeepSpeed ZeRO-2 writes a folder
with its own ``save_state``, whose DeepSpeed files sit in a subfolder; the import of that
folder must unpickle nothing unless ``trust_pickle is True``.

    import_worker.py OUT     writes its checks (tests.checks.Checks) to OUT/results.json

The folder keeps only what Accelerate's DeepSpeed loader reads: ``latest`` (a text file) and
``pytorch_model/`` (DeepSpeed's ``*.pt``, read with full unpickling); the model-states file
also holds a payload that creates OUT/trace when unpickled. No top-level file is a pickle, so
only a check of the subfolders sees what will be unpickled.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

with socket.socket() as s:  # a world of one, before Accelerate sets up DeepSpeed's group
    s.bind(("127.0.0.1", 0))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(s.getsockname()[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=FutureWarning)

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

import shardkeeper.accelerate as ska  # noqa: E402
from shardkeeper.core import CheckpointManager  # noqa: E402

from tests.checks import Checks  # noqa: E402
from tests.hostile_pickle import UNTRUSTED, Trace  # noqa: E402

OUT = sys.argv[1]
DS_CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
checks = Checks(rank=0)
check = checks.check


def main() -> None:
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DS_CONFIG)))
    check("distributed_type", str(acc.distributed_type.value) == "DEEPSPEED", acc.distributed_type)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    engine, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
    acc.backward(engine(torch.randn(4, 3)).sum())
    opt.step()
    folder, trace = os.path.join(OUT, "checkpoint_5"), os.path.join(OUT, "trace")
    Accelerator.save_state(acc, folder)  # Accelerate's own format
    for name in os.listdir(folder):  # keep what the DeepSpeed loader reads
        if name not in ("latest", "pytorch_model"):
            os.remove(os.path.join(folder, name))
    states = os.path.join(folder, "pytorch_model", "mp_rank_00_model_states.pt")
    sd = torch.load(states, weights_only=False)
    sd["trace"] = Trace(trace)
    torch.save(sd, states)
    check("folder_as_written", sorted(os.listdir(folder)) == ["latest", "pytorch_model"], os.listdir(folder))

    ska.enable(acc, root=os.path.join(OUT, "sk"), async_save=False)
    for trust in UNTRUSTED:
        try:
            ska.import_accelerate_checkpoint(acc, folder, trust_pickle=trust)
        except PermissionError as e:
            msg = str(e)
            check(f"refused {trust!r}", msg.startswith(f"{folder}: ") and "pytorch_model/mp_rank_00_model_states.pt"
                  in msg and "trust_pickle=True" in msg, msg)
        except Exception as e:  # noqa: BLE001 - recorded
            check(f"refused {trust!r}", False, f"{type(e).__name__}: {e}")
        else:
            check(f"refused {trust!r}", False, "imported")
        check(f"nothing unpickled with {trust!r}", not os.path.exists(trace), "the payload ran")
        if os.path.exists(trace):
            os.rmdir(trace)
    check("nothing saved while refused", not os.path.exists(os.path.join(OUT, "sk")), os.listdir(OUT))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        path = ska.import_accelerate_checkpoint(acc, folder, trust_pickle=True)
    check("trusted import warns", any("unpickling" in str(w.message) for w in seen), [str(w.message) for w in seen])
    check("trusted import runs DeepSpeed's loader", os.path.isdir(trace))
    check("trusted import commits the step", path.endswith("step-000000000005"), path)
    with CheckpointManager(os.path.join(OUT, "sk")) as mgr:
        keys = set(mgr.manifest(5).leaves)
    check("imported keys", {"model/weight", "model/bias"} <= keys, sorted(keys))
    acc.end_training()


if __name__ == "__main__":
    checks.guard("whole run", main)
    checks.write(os.path.join(OUT, "results.json"))
