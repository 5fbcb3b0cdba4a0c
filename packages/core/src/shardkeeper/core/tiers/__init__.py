"""Two-tier checkpoints: a node-local tier (each node's own directory, peer replicas on other
nodes) in front of the persistent root (docs/tiers.md).

``strategy.py`` is what a ``CheckpointManager`` holds, with one tier (its root alone) or two
(``two_tiers.py``): the save's hooks, restore, ``delete()``, retention and close.
``opening.py`` opens both roots (``runtime/binding.py`` ties a node's directory to its
persistent root); ``tiering.py`` holds the two tiers' state; ``nodes.py`` finds which ranks
share a local directory and where replicas go; ``wire.py`` moves bytes and JSON over the
tiers' own gloo group; ``transfer.py`` moves whole files between nodes (replicas during a
save, a node's copy made whole at restore; ``tee.py`` keeps a save's bytes until its
replicas are sent); ``record.py`` records a local commit on every
node; ``choose.py`` agrees at restore on the tier and the newest step whole somewhere;
``restore.py`` restores it and falls back across the tiers (``repair.py`` first replaces a
node's damaged copies by other nodes' good ones); ``persist.py`` uploads steps
from the local files to the persistent root (``commit/claim.py`` claims each step there
before its local commit, so a second writer of a step is refused at its save); ``drop.py``
removes local steps no tier holds whole. With ``erasure=(k, m)`` instead of replicas,
``placement.py`` says where a group's parity lies, ``parity.py`` computes it during a save
(``erasure.py``: the code) and ``rebuild.py`` rebuilds lost nodes' files from it at restore.
With ``writer="process"``, ``process_writer.py`` runs the save's side of the tiers in the
persist processes.
"""

__all__: list[str] = []
