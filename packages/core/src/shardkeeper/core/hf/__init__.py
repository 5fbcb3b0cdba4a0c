"""Hugging Face safetensors folders as a source: ``load_hf`` (hf/load.py) reads one into a
(sharded) target through restore's machinery, ``import_hf`` (hf/importer.py) makes a committed
step of one. ``hf/folder.py`` reads and checks the folder's index and shard headers (no torch);
``hf/view.py`` presents the selected, renamed and tied tensors as the manifest restore reads.

Loads nothing on import: ``shardkeeper.core`` names the entry points lazily.
"""

__all__: list[str] = []
