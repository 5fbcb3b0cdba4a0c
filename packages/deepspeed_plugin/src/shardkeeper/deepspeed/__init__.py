"""shardkeeper adapter for DeepSpeed: ZeRO-1/2/3 engines as shardkeeper's canonical state.

- ``engine_state(engine)``: the engine's ``model`` / ``optim`` / ``sched`` / ``progress``
  entries for ``CheckpointManager.save`` / ``restore`` (fp32 master weights and optimizer
  moments as per-parameter fragments, so they restore at any world size and ZeRO stage, and
  into plain torch / FSDP2, and the reverse).
- ``attach(engine, root)``: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` go through
  shardkeeper from then on.
- ``import_native_checkpoint(src, root)``: a native DeepSpeed checkpoint directory as a
  committed shardkeeper step.
- ``load_pretrained(engine, path)``: the engine's model from a Hugging Face safetensors folder
  (``shardkeeper.core.load_hf`` into its fp32 master weights).

Imports only the public API of shardkeeper.core and DeepSpeed itself, never another adapter;
every private DeepSpeed attribute it touches is in ``_ds_internals``.
"""

from shardkeeper.deepspeed.hook import DeepSpeedCheckpointHook, attach, tag_to_step
from shardkeeper.deepspeed.native import import_native_checkpoint
from shardkeeper.deepspeed.pretrained import load_pretrained
from shardkeeper.deepspeed.state import engine_state, ensure_optimizer_state

__all__ = [
    "DeepSpeedCheckpointHook",
    "attach",
    "engine_state",
    "ensure_optimizer_state",
    "import_native_checkpoint",
    "load_pretrained",
    "tag_to_step",
]
