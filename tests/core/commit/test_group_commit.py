"""Group commit (docs/protocol.md, "Group commit"; docs/format.md 3.9) on a real gloo
process group: at 4 ranks with ``commit_group_ranks=2`` the coordinator is a group of its own,
rank 1 leads ranks 1 and 2, rank 3 itself; the leaders fold their groups' reports and write
pages; the manifest lists the pages, not the ranks' records; restores are
bit-exact in every layout and read only the pages they need; verify, gc, a damaged page, a
differing rank named through its leader, differing group sizes refused."""

from __future__ import annotations

import base64
import json

import pytest

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("group")
    out = tmp / "out"
    out.mkdir()
    key = base64.b64encode(bytes(range(32))).decode()
    res = run_workers(4, "group_worker.py", str(tmp / "root"), str(out), timeout_s=240, env={"SK_GROUP_KEY": key})
    assert res.returncode == 0, res.stdout[-4000:]
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(4)]


def test_the_manifest_lists_one_page_per_group_and_no_rank_records(seen: list[dict]) -> None:
    s = seen[0]
    assert s["version"] == [1, ["described", "pages"]]
    pages = s["pages"]
    assert pages["first"] == [0, 1, 3] and pages["count"] == [1, 2, 1]
    assert [p.rsplit("/", 1)[1][:6] for p in pages["path"]] == ["g00000", "g00001", "g00003"]
    # each rank's data file and index file, but rank 0's data file: the replicated tensor's
    # enumerated chunk lies in it, so the manifest's own files list it
    assert pages["files"] == [1, 4, 2]
    assert s["index entries"] == []
    # the manifest's own files: the pages, and the file of the replicated tensor's chunks
    assert set(pages["path"]) < set(s["files"]) and len(s["files"]) == 4


@pytest.mark.parametrize("target", ["same", "other", "plain"])
def test_restores_are_bit_exact(seen: list[dict], target: str) -> None:
    assert [s[f"{target} wrong"] for s in seen] == [[]] * 4


def test_a_restore_reads_only_the_pages_of_the_ranks_that_wrote_what_it_needs(seen: list[dict]) -> None:
    # the same layout: ranks 0 and 1 wrote every box they restore (their own, and the replicas
    # of the replicated layouts): the pages of ranks 0 and 1, never rank 3's; ranks 2 and 3
    # also need those replicas, and each other's
    assert [s["same pages read"] for s in seen] == [2, 2, 3, 3]
    assert [s["other pages read"] for s in seen] == [3, 3, 3, 3]


def test_verify_passes_and_gc_keeps_every_paged_file(seen: list[dict]) -> None:
    assert seen[0]["verify"] == []
    assert not [p for p in seen[0]["gc removed"] if "step-000000000001" in p]
    assert [s["after gc wrong"] for s in seen] == [[]] * 4


def test_a_differing_rank_is_named_through_its_leaders_report(seen: list[dict]) -> None:
    for s in seen:
        assert s["mismatch"] is not None and "ranks [2] hold states" in s["mismatch"], s["mismatch"]


def test_a_replica_one_ulp_off_is_named_through_its_leaders_folded_sums(seen: list[dict]) -> None:
    for s in seen:
        err = s["replica off"]
        assert err is not None and "step 3" in err and "tensor 'm/plain'" in err and "[2]" in err, err


def test_a_damaged_page_is_refused_naming_its_ranks(seen: list[dict]) -> None:
    for s in seen:
        assert s["damaged"] is not None and "CorruptCheckpointError" in s["damaged"]
    assert "(the records of ranks 1 to 2) does not match the size and digest" in seen[2]["damaged"]
    said = seen[0]["damaged verify"]
    # the page once, the first leaf it keeps unchecked, then the count of the others
    assert all("ranks 1 to 2" in m for m in said) and "more leaves" in said[-1] and len(said) == 3, said
    # the files of an intact page are still checked
    assert any(
        "r00003-" in m and "longer than recorded" in m and "its page records" in m for m in seen[0]["damaged verify 2"]
    )


def test_a_step_with_a_damaged_page_can_be_deleted_and_gc_runs_after(seen: list[dict]) -> None:
    assert [s["damaged deleted"] for s in seen] == [True] * 4
    assert seen[0]["gc after"] is None and not seen[0]["step 1 left"]


def test_ranks_with_differing_group_sizes_are_refused(seen: list[dict]) -> None:
    for s in seen:
        assert s["differing sizes"] is not None and "commit_group_ranks differs" in s["differing sizes"]


def test_incremental_references_in_pages_survive_retention(seen: list[dict]) -> None:
    assert all(p.startswith("../step-000000000001/") for p in seen[0]["inc references"])
    assert seen[0]["inc references"] and not seen[0]["inc step 1 manifest"]
    assert [s["inc wrong"] for s in seen] == [[]] * 4
    assert seen[0]["inc verify"] == []


def test_pages_of_an_encrypted_root_are_read_with_and_without_the_key(seen: list[dict]) -> None:
    assert seen[0]["enc pages"] == 3 and seen[0]["enc page plain"] == [True] * 3
    assert [s["enc wrong"] for s in seen] == [[]] * 4
    assert seen[0]["enc verify"] == [] and seen[0]["enc verify keyless"] == []
    assert seen[0]["enc gc"] is None  # gc has no key: it reads the pages as they are


def test_a_file_lost_before_its_leaders_check_fails_the_save_on_every_rank(seen: list[dict]) -> None:
    for s in seen:
        assert s["lost file"] is not None and "failed on rank 1 in phase commit" in s["lost file"], s["lost file"]
        assert "(written by rank 2) is missing at commit time" in s["lost file"]
        assert not s["step 4 committed"]


def test_the_coordinators_page_not_written_fails_the_save_once_the_write_ended(seen: list[dict]) -> None:
    """The coordinator syncs its own group's page while it merges; it waits for it before its
    commit's intent, so a page that cannot be written fails the save, as any leader's does."""
    for s in seen:
        msg = s["page lost"]
        assert msg is not None and "failed on rank 0 in phase commit" in msg, msg
        assert "injected: the page could not be synced" in msg
        assert not s["step 5 committed"]
    assert seen[0]["page write ended first"]


def test_a_rank_that_never_reports_is_named_by_its_leader_on_every_other_rank(seen: list[dict]) -> None:
    for s in (seen[0], seen[1], seen[3]):
        msg = s["missing rank"]
        assert msg is not None and "failed on rank 1 in phase commit" in msg, msg
        assert "ranks [2] did not report to their group leader, rank 1, within 3 s" in msg
