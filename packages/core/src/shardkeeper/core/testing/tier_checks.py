"""What the tier campaign (``tier_campaign``) checks after each launch of its simulated
nodes, and its summary: every rank restored the newest step committed on the nodes left or
at the persistent root, bit for bit, from the tier that holds it; nothing acknowledged is
lost, nothing never saved is listed; what is left of uncommitted steps at the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkeeper.core.testing.trial_checks import Summary, check_persistent


@dataclass
class TierSummary(Summary):
    """``Summary`` and what only the tier campaign counts."""

    nodes: int = 0
    erasure: tuple[int, int] = (1, 1)
    nodes_replaced: int = 0
    killed_in_restore: int = 0  # victims killed before their restore returned
    restores: Counter[str] = field(default_factory=Counter)  # by tier ("none": nothing committed yet)
    restores_after_node_loss: int = 0  # local restores right after a node lost its directory
    rebuilt_from_parity: int = 0  # of those, the ones whose step the lost node held alone (with parity)
    orphan_parity_left: list[str] = field(default_factory=list)
    uncommitted_dirs_left: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update(
            nodes=self.nodes,
            erasure=list(self.erasure),
            nodes_replaced=self.nodes_replaced,
            killed_in_restore=self.killed_in_restore,
            restores_by_tier=dict(sorted(self.restores.items())),
            local_restores_after_node_loss=self.restores_after_node_loss,
            rebuilt_from_parity=self.rebuilt_from_parity,
            orphan_parity_left=self.orphan_parity_left,
            uncommitted_dirs_left=self.uncommitted_dirs_left,
        )
        return out


@dataclass
class Ran:
    """What one launch left: each rank's restore report, the steps acknowledged, how it ended."""

    reports: list[dict[str, Any] | None]
    acked: set[int]
    said: dict[int, str]  # rank -> its error
    killed: bool  # the victim died by SIGKILL
    save_s: float  # from the last restore report to the end
    restore_s: float = 0.0  # from the start to the last restore report (0: some rank never reported)


def _manifests(node: Path) -> set[int]:
    from shardkeeper.core.format.layout import parse_step_dir

    if not node.is_dir():
        return set()
    return {s for p in node.iterdir() if (s := parse_step_dir(p.name)) is not None and (p / "manifest.json").is_file()}


@dataclass
class Expect:
    """What the next launch must restore: ``step`` (None: nothing) from ``tier``."""

    step: int | None
    tier: str
    after_loss: bool = False
    rebuild: bool = False  # a lost node held its files alone: the restore rebuilds them from parity


def _expect(nodes: list[Path], persistent: Any, lost: bool) -> Expect:
    from shardkeeper.core.commit.committed import committed_steps

    local = max((s for n in nodes for s in _manifests(n)), default=None)
    persisted = list(committed_steps(persistent))
    if local is not None and (not persisted or local >= persisted[-1]):
        return Expect(local, "local", lost)
    return Expect(persisted[-1], "persistent") if persisted else Expect(None, "none")


def _tail(path: Path, n: int = 1200) -> str:
    try:
        return path.read_text(errors="replace")[-n:].replace("\n", " | ")
    except OSError:
        return "(no log)"


def check_restores(
    ran: Ran, expect: Expect, where: str, logs: Path, index: int, s: TierSummary, killed_in_restore: bool = False
) -> None:
    """Every rank restored what ``expect`` says, bit for bit, from the tier it says (with
    ``killed_in_restore``, every rank that got to say what it restored)."""
    bad = []
    for r, rep in enumerate(ran.reports):
        log = logs / f"launch{index:03d}-r{r}.log"
        if rep is None and killed_in_restore:
            continue
        if rep is None:
            bad.append(f"rank {r} did not restore: {ran.said.get(r, 'no report')}; log: {_tail(log)}")
        elif rep["restored"] != expect.step:
            bad.append(f"rank {r} restored step {rep['restored']}, but the newest committed is {expect.step}")
        elif expect.step is not None and not rep["exact"]:
            bad.append(f"rank {r}: step {expect.step} did not restore bit for bit")
        elif expect.step is not None and rep["tier"] != expect.tier:
            bad.append(f"rank {r} restored step {expect.step} from the {rep['tier']} tier, not the {expect.tier}")
        elif expect.tier == "local" and rep["persistent_reads"]:
            bad.append(f"rank {r} read {rep['persistent_reads']} bytes from the persistent root")
        elif rep["newer"]:
            bad.append(f"rank {r} lists step(s) {rep['newer']} newer than step {expect.step} it restored")
    s.failures += [f"{where}: {b}" for b in bad]
    if not bad and not killed_in_restore:
        s.restores[expect.tier] += 1
        s.restores_bit_exact += expect.step is not None
        s.restores_after_node_loss += expect.after_loss and expect.tier == "local"
        s.rebuilt_from_parity += expect.rebuild and expect.tier == "local"


def gc_nodes(nodes: list[Path], s: TierSummary) -> None:
    """``collect_garbage`` on every node's directory (no process runs): the removed count."""
    from shardkeeper.core.lifecycle.gc import collect_garbage
    from shardkeeper.core.storage import open_storage

    for n in nodes:
        if n.is_dir():
            try:
                report = collect_garbage(open_storage(str(n)), min_age_s=0.0, no_running_saves=True)
            except Exception as e:
                s.failures.append(f"gc of {n} failed: {type(e).__name__}: {e}")
                continue
            s.leftovers_removed += len(report.removed_paths)


def leftovers(nodes: list[Path], s: TierSummary) -> None:
    """Parity of steps no node holds a manifest of, and step directories without one: failures."""
    from shardkeeper.core.format.layout import parse_step_dir
    from shardkeeper.core.storage import open_storage
    from shardkeeper.core.testing.trial_checks import pointed_at

    committed = {x for n in nodes for x in _manifests(n)}
    for n in nodes:  # (the steps the committed ones point at keep their files, and the parity of them)
        committed |= pointed_at(open_storage(str(n)), sorted(_manifests(n))) if n.is_dir() else set()
    for n in nodes:
        for sub, out in ((n / ".parity", s.orphan_parity_left), (n, s.uncommitted_dirs_left)):
            for p in sorted(sub.iterdir()) if sub.is_dir() else ():
                step = parse_step_dir(p.name)
                if step is not None and step not in committed:
                    out.append(str(p))
    if s.orphan_parity_left or s.uncommitted_dirs_left:
        s.failures.append(
            f"after gc of the nodes and a save, uncommitted leftovers stay: step directories without a manifest "
            f"{s.uncommitted_dirs_left}, parity of steps without one {s.orphan_parity_left}"
        )


def count_end(s: TierSummary, d: dict[str, Any], ran: Ran, where: str) -> bool:
    """Count how the launch ended: its victim killed, every rank done, or a rank's own
    failure (a writer error); returns whether every rank completed."""
    if ran.killed:
        s.killed += 1
        s.points_hit[d["point"]] += 1
    elif ran.said:
        s.writer_errors += [f"{where}: rank {r}: {e}" for r, e in sorted(ran.said.items())]
    else:
        s.completed += 1
    return not ran.killed and not ran.said


def judge(
    s: TierSummary,
    where: str,
    restored: int | None,
    dirs: list[Path],
    persistent: Any,
    lost: bool,
    ran: Ran,
    attempted: int,
) -> Expect:
    """After a launch (``restored``: the step it restored): the persistent root checked, and
    what the next launch must restore, never older than a step acknowledged nor one never saved."""
    check_persistent(persistent, where, s)
    expect = _expect(dirs, persistent, lost)
    # a step newer than the one restored at the launch's start lies on each node alone (every
    # node's copy of the restored one was made whole)
    expect.rebuild = lost and expect.step is not None and (restored is None or expect.step > restored)
    newest_acked = max(ran.acked, default=None)
    if newest_acked is not None and (expect.step is None or expect.step < newest_acked):
        s.failures.append(f"{where}: step {newest_acked} was acknowledged, but the newest committed is {expect.step}")
    if expect.step is not None and expect.step > attempted:
        s.failures.append(f"{where}: step {expect.step} is committed but was never saved")
    return expect


__all__ = ["Expect", "Ran", "TierSummary", "check_restores", "count_end", "judge", "leftovers"]
