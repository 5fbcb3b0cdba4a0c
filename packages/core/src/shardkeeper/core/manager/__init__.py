"""The object a training loop holds: ``CheckpointManager``, a facade that sequences the phases below it."""

__all__: list[str] = []
