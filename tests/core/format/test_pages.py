"""Pages (docs/format.md 3.9): what a reader checks of the manifest's page columns and of a
page's bytes, each refusal naming what is wrong. (tests/core/commit/test_group_commit.py saves and restores
through pages on real process groups.)"""

from __future__ import annotations

import json

import pytest

from shardkeeper.core.format.pages import Pages, encode_page, parse_page

FILES = {
    "data/r00002-a.index.json": {"size_bytes": 10, "rank": 2},
    "data/r00002-a-000.safetensors": {"size_bytes": 100, "rank": 2},
    "data/r00003-a-000.safetensors": {"size_bytes": 50, "rank": 3},
}
INDEX = [["data/r00002-a.index.json", 10, "ab" * 16], None]
ENDS = {"data/r00002-a-000.safetensors": 100}


def page_bytes(**change: object) -> bytes:
    doc = json.loads(encode_page(7, 2, FILES, INDEX, ENDS))
    doc.update(change)
    return json.dumps(doc).encode()


def test_a_page_round_trips() -> None:
    page = parse_page(encode_page(7, 2, FILES, INDEX, ENDS), step=7, first=2, count=2)
    assert page.entry(2) == ("data/r00002-a.index.json", 10, "ab" * 16)
    assert page.entry(3) == (None, 0, "")
    assert page.files == FILES and page.ends == ENDS


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"step": 6}, "says it is of step 6"),
        ({"first": 0}, "holds ranks from 0"),
        ({"page_schema": 2}, "page_schema 2"),
        ({"files": {**FILES, "/etc/passwd": {"size_bytes": 1, "rank": 2}}}, "not a data file of its step"),
        ({"files": {**FILES, "manifest.json": {"size_bytes": 1, "rank": 2}}}, "not a data file of its step"),
        ({"files": {**FILES, "data/x": {"size_bytes": 1, "rank": 9}}}, "of rank 9, not one of its ranks"),
        ({"files": {**FILES, "data/x": {"size_bytes": -1, "rank": 2}}}, "non-negative integer"),
        ({"index": {"path": [None], "size": [0], "digest": [""]}}, "list 1, 1, 1 ranks, not 2"),
        ({"chunk_files": {"path": ["data/r00002-a-000.safetensors"], "end": [101]}}, "reach byte 101"),
    ],
)
def test_a_wrong_page_is_refused_saying_why(change: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("/", "/")):
        parse_page(page_bytes(**change), step=7, first=2, count=2)


def columns(**change: object) -> dict:
    cols = {"path": ["p0", "p1"], "size": [50, 60], "digest": ["d", "e"], "first": [0, 2], "count": [2, 2]}
    cols |= {"files": [3, 4], "bytes": [10, 20]}
    return {**cols, **change}


LISTED = {"p0": {"size_bytes": 50, "rank": 0}, "p1": {"size_bytes": 60, "rank": 2}}


def test_columns_that_cover_the_world_in_order_pass() -> None:
    assert Pages(columns()).problem(4, LISTED) is None


@pytest.mark.parametrize(
    ("change", "world", "why"),
    [
        ({}, 5, "hold 4 ranks, not the world's 5"),
        ({"first": [0, 1]}, 4, "holds ranks from 1, 2 of them; the next rank is 2"),
        ({"count": [2, 0]}, 4, "holds ranks from 2, 0 of them"),
        ({"size": [50, 70]}, 4, "not listed in files with its size"),
        ({"path": ["p0", "p9"]}, 4, "is not a file of its step"),
        ({"bytes": [1]}, 4, "not arrays of one length"),
        ({"files": [1, -1]}, 4, "files are not non-negative integers"),
    ],
)
def test_wrong_columns_are_refused(change: dict, world: int, why: str) -> None:
    assert why in (Pages(columns(**change)).problem(world, LISTED) or "")


def test_a_page_is_not_read_without_its_storage() -> None:
    from shardkeeper.core.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match="parsed without its storage"):
        Pages(columns()).get(0)


def test_a_page_read_back_with_another_digest_names_its_ranks() -> None:
    from shardkeeper.core.errors import CorruptCheckpointError

    pages = Pages(columns())
    pages.attach(lambda rel, size: b"x" * size, lambda data: "other", lambda rel: f"<{rel}>", 7)
    with pytest.raises(CorruptCheckpointError, match=r"page <p1> \(the records of ranks 2 to 3\) does not match"):
        pages.rank(3)
    with pytest.raises(CorruptCheckpointError):  # damage read once, said again
        pages.rank(2)
    assert pages.reads == 1


def attached(pages_bytes: list[bytes], **change: object) -> Pages:
    """Pages over these pages' bytes (columns as their writer gives them, then ``change``)."""
    import xxhash

    docs = [json.loads(b) for b in pages_bytes]
    cols = {
        "path": [f"pages/g{d['first']:05d}-a.index.json" for d in docs],
        "size": [len(b) for b in pages_bytes],
        "digest": [xxhash.xxh3_128_hexdigest(b) for b in pages_bytes],
        "first": [d["first"] for d in docs],
        "count": [d["count"] for d in docs],
        "files": [len(d["files"]) for d in docs],
        "bytes": [sum(r["size_bytes"] for r in d["files"].values()) for d in docs],
    }
    pages = Pages({**cols, **change})
    data = dict(zip(cols["path"], pages_bytes))
    pages.attach(lambda rel, size: data[rel], lambda b: xxhash.xxh3_128_hexdigest(b), str, 7)
    return pages


def test_a_page_whose_files_differ_from_the_manifests_counts_is_damage() -> None:
    from shardkeeper.core.errors import CorruptCheckpointError

    first = encode_page(7, 0, {"data/r00000-a-000.safetensors": {"size_bytes": 5, "rank": 0}}, [None, None], {})
    assert attached([first, encode_page(7, 2, FILES, INDEX, ENDS)]).files().keys() == {
        "data/r00000-a-000.safetensors",
        *FILES,
    }
    with pytest.raises(CorruptCheckpointError, match="lists 3 files of 160 bytes, the manifest says 3 of 999"):
        attached([first, encode_page(7, 2, FILES, INDEX, ENDS)], bytes=[5, 999]).files()


def test_a_file_two_pages_list_is_damage_and_verify_can_skip_a_damaged_page() -> None:
    from shardkeeper.core.errors import CorruptCheckpointError

    twice = {"data/r00002-a-000.safetensors": {"size_bytes": 100, "rank": 0}}
    pages = attached([encode_page(7, 0, twice, [None, None], {}), encode_page(7, 2, FILES, INDEX, ENDS)])
    with pytest.raises(CorruptCheckpointError, match="which an earlier page lists too"):
        pages.files()
    damaged = attached([encode_page(7, 0, {}, [None, None], {}), encode_page(7, 2, FILES, INDEX, ENDS)])
    damaged.digest[0] = "0" * 32
    said: list[str] = []
    assert damaged.files(lambda rel, e: said.append(rel)) == FILES  # the intact page's files
    assert said == ["pages/g00000-a.index.json"] and damaged.file_ends(skip_damaged=True) == ENDS
