"""The demo's training job: a small transformer language model, checkpointed with shardkeeper.

    torchrun --nproc-per-node 2 demo/train.py --root DIR --steps 30 --save-every 5 --die-at 27
    python demo/train.py --root DIR --resume-only           # one process, no process group
    torchrun --nproc-per-node 3 demo/train.py --root DIR --resume-only

Under torchrun the model is sharded with FSDP2; in one process it is a plain module. Every
committed save records a fingerprint (sha256 of the full parameters and AdamW state) so that a
resume can prove it got the same state back, whatever the world size or layout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardkeeper.core import CheckpointManager, RNGState

VOCAB, DIM, SEQ, BATCH = 256, 64, 32, 8
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, batch_first=True, dropout=0.0)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM()
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    tokens = batch(step)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and optimizer-state tensor, full (unsharded), by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    opts = StateDictOptions(full_state_dict=True)
    flat = {f"model/{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, st in get_optimizer_state_dict(model, opt, options=opts)["state"].items():
        flat.update({f"optim/{fqn}/{n}": v for n, v in st.items()})
    h = hashlib.sha256()
    for k in sorted(flat):
        v = flat[k]
        v = v.full_tensor() if isinstance(v, DTensor) else v
        h.update(k.encode())
        h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--die-at", type=int, default=None, help="SIGKILL rank 0 right after this step's save() returns")
    ap.add_argument("--resume-only", action="store_true", help="restore the newest step, fingerprint it, train 3 steps")
    args = ap.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    root = Path(args.root)
    log = root.parent / "fingerprints.jsonl"

    model, opt = build()
    progress = {"step": 0}
    state = {"model": model, "optim": opt, "progress": progress, "rng": RNGState()}
    mgr = CheckpointManager(
        root, keep_last=3, per_rank="modulo", metadata={"run": "demo", "layout": "fsdp2" if world > 1 else "plain"}
    )
    start = 0
    if mgr.steps():
        start = mgr.restore(state)
        fp = fingerprint(model, opt)
        if rank == 0:
            print(f"[world {world}] restored step {start}: fingerprint {fp}", flush=True)
            with open(log, "a") as f:
                f.write(json.dumps({"event": "restored", "world": world, "step": start, "fingerprint": fp}) + "\n")
    end = start + 3 if args.resume_only else args.steps
    for step in range(start + 1, end + 1):
        loss = train_step(model, opt, step)
        progress["step"] = step
        if step % args.save_every == 0 and not args.resume_only:
            fp = fingerprint(model, opt)  # the state being saved, for the demo's comparison
            handle = mgr.save(step, state)
            if rank == 0:
                print(
                    f"[world {world}] step {step}: loss {loss:.4f}, save() returned after {handle.stall_s * 1e3:.1f} ms",
                    flush=True,
                )
                with open(log, "a") as f:
                    f.write(json.dumps({"event": "saved", "world": world, "step": step, "fingerprint": fp}) + "\n")
            if args.die_at == step and rank == 0:
                print(f"[world {world}] rank 0 is killed (SIGKILL) with the save of step {step} in flight", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    if args.resume_only and rank == 0:
        print(f"[world {world}] trained on to step {end}: loss {loss:.4f}", flush=True)
    mgr.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
