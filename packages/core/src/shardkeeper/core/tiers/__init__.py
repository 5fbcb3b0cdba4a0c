"""Two-tier checkpoints: a node-local tier (each node's own directory, peer replicas on other
nodes) in front of the persistent root (docs/tiers.md).

``nodes.py`` finds which ranks share a local directory and where replicas go; ``wire.py``
moves bytes and JSON over the tiers' own gloo group; ``replicate.py`` sends each rank's files
to its peers during a save; ``record.py`` records a local commit on every node;
``listing.py`` and ``choose.py`` agree at restore on the newest step that is whole somewhere;
``persist.py`` uploads every Nth step from the local files to the persistent root;
``tiering.py`` ties them to a ``CheckpointManager``.
"""

__all__: list[str] = []
