"""A user's Accelerate script that saves and ends without end_training() (or close/wait).

    exit_script.py ROOT WIDTH       # writes ROOT.ref.safetensors: the model as saved
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

import shardkeeper.accelerate as ska

root, width = sys.argv[1], int(sys.argv[2])
acc = Accelerator(cpu=True)
ska.enable(acc, root)
torch.manual_seed(width)
model = torch.nn.Linear(width, 64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
loss = model(torch.randn(4, width)).square().mean()
acc.backward(loss)
opt.step()
# the reference first: anything slow after the save would give it time to finish before the exit
save_file({k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}, root + ".ref.safetensors")
acc.save_state()
print("RESULT {\"saved\": true}", flush=True)
