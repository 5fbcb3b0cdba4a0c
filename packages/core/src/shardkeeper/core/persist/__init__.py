"""``writer="process"``: saves written and committed by a persist process per rank, outside the
trainer's interpreter (``client.py``: the trainer's side; ``worker.py``: the process;
``channel.py``: what passes between them; ``locks.py``: which saves are still committing;
``uploads.py``: a local tier's uploads, asked of the process)."""

__all__: list[str] = []
