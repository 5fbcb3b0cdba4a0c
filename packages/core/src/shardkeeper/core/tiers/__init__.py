"""Two-tier checkpoints: a node-local tier (each node's own directory, peer replicas on other
nodes) in front of the persistent root (docs/tiers.md).

``binding.py`` ties a node's directory to its persistent root (and refuses one as a root);
``nodes.py`` finds which ranks share a local directory and where replicas go; ``wire.py``
moves bytes and JSON over the tiers' own gloo group; ``transfer.py`` moves whole files
between nodes (replicas during a save, a node's copy made whole at restore); ``record.py``
records a local commit on every node; ``choose.py`` agrees at restore on the tier and the
newest step whole somewhere; ``restore.py`` restores it and falls back across the tiers;
``persist.py`` uploads steps from the local files to the persistent root; ``claim.py`` claims
each step there before its local commit, so a second writer of a step is refused at its save;
``drop.py``
removes local steps no tier holds whole; ``tiering.py`` and ``view.py`` tie them to a
``CheckpointManager``.
"""

__all__: list[str] = []
