"""A Hugging Face safetensors folder, read through the storage layer and checked as the
safetensors reader checks it (no torch).

The folder holds ``model.safetensors``, or shards that ``model.safetensors.index.json`` names
(its ``weight_map``: tensor name -> file); like transformers' ``from_pretrained``, the single
file wins when both are there. Each file starts with an 8-byte little-endian header length
and a JSON header that gives every tensor's dtype, shape and byte range (``data_offsets``,
relative to the data section after the header): a chunk table of whole-tensor chunks.

The index and the headers are untrusted input: parsed by ``loads_untrusted`` (bounded size and
depth) and held to the bounds of the safetensors reader before a tensor byte is read: a
header of at most 100 MB that fits its file; entries with a dtype, a shape of non-negative
sizes and a byte range holding exactly that many bytes; ranges that tile the data section (in
order, no gap, no overlap, to its end). A file that breaks them is a ``CorruptCheckpointError``
naming the file, the tensor and the remedy. Headers are read only for the files that hold the
tensors asked for, two small ranged reads each.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UntrustedJSONError
from shardkeeper.core.format.records import DTYPES, safe_relative_path
from shardkeeper.core.format.safetensors import PAD_PREFIX
from shardkeeper.core.format.untrusted import loads_untrusted
from shardkeeper.core.storage.base import Storage

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: transformers' legacy pickled weights: named in the refusal of a folder that holds only them.
PICKLED_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: The safetensors format's own limit on a header.
MAX_HEADER_BYTES = 100_000_000
#: An index lists one name and file per tensor: a million tensors take well under this.
MAX_INDEX_BYTES = 256 << 20
#: safetensors dtype code -> the format's dtype name (codes the format lacks are absent).
DTYPE_OF_CODE = {code: name for name, (code, _) in DTYPES.items()}
REMEDY = (
    "the folder is damaged or was not written by a safetensors writer: download it again "
    "(huggingface_hub.snapshot_download(..., force_download=True)) or check where it came from"
)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a shard file, as its header declares it."""

    name: str
    file: str  # relative to the folder
    code: str  # the safetensors dtype code ("BF16", "F8_E4M3", ...)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of its first byte in the file
    length: int

    @property
    def dtype(self) -> str | None:
        """The format's dtype name; None for a code the format does not store (F8_E8M0, F4, ...)."""
        return DTYPE_OF_CODE.get(self.code)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _entry_problem(entry: Any, data_len: int) -> str | None:
    """What is wrong with one header entry (``data_len``: the data section's size), or None."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return "the entry is not an object with dtype, shape and data_offsets"
    code, shape, span = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str):
        return f"dtype {code!r} is not a string"
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not isinstance(span, list) or len(span) != 2 or not all(_is_int(x) for x in span):
        return f"data_offsets {span!r} is not a pair of integers"
    begin, end = span
    if not 0 <= begin <= end <= data_len:
        return f"data_offsets [{begin}, {end}] leave the data section ({data_len} bytes)"
    name = DTYPE_OF_CODE.get(code)
    if name is not None and end - begin != math.prod(shape) * DTYPES[name][1]:
        return (
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes, but a {code} tensor of shape "
            f"{shape} takes {math.prod(shape) * DTYPES[name][1]}"
        )
    return None


def parse_header(raw: bytes, file: str, data_start: int, file_size: int, where: str) -> dict[str, Tensor]:
    """The tensors of the header ``raw`` of ``file`` (its data section: ``data_start`` to
    ``file_size``); ``where`` names the file in errors."""
    try:
        doc = loads_untrusted(raw, max_bytes=MAX_HEADER_BYTES)
    except UntrustedJSONError as e:
        raise CorruptCheckpointError(f"{where}: the safetensors header {e}; {REMEDY}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: the safetensors header is not a JSON object; {REMEDY}")
    data_len = file_size - data_start
    out: dict[str, Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry, data_len)
        if problem is not None:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} of the safetensors header: {problem}; {REMEDY}")
        begin, end = entry["data_offsets"]
        spans.append((begin, end, name))
        out[name] = Tensor(name, file, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} starts at byte {begin} of the data section, not at byte {pos} where "
                f"the tensor before it ends (safetensors ranges follow each other without gap or overlap); {REMEDY}"
            )
        pos = end
    if pos != data_len:
        raise CorruptCheckpointError(
            f"{where}: the header's tensors end at byte {pos} of the data section, which is {data_len} bytes "
            f"long (a truncated file, or bytes no tensor declares); {REMEDY}"
        )
    return out


class Folder:
    """The safetensors folder ``dir`` of ``storage`` ("": its root): the tensor names and the
    file of each, from the index or the single file's header; ``tensors`` reads the headers
    of the files that hold the tensors asked for, each once. ``rank``: the reading rank,
    named in errors."""

    def __init__(self, storage: Storage, dir: str = "", *, rank: int | None = None) -> None:
        self.storage = storage
        self.dir = dir
        self._who = "" if rank is None else f" (rank {rank})"
        self.where = self.describe(dir)
        self.sizes: dict[str, int] = {}  # file -> size, for the files whose header was read
        self._headers: dict[str, dict[str, Tensor]] = {}
        self.index = ""  # the index file's name, when the folder has one and uses it
        if storage.exists(self.path(SINGLE_NAME)):
            head = self._header(SINGLE_NAME)
            self.weight_map = {n: SINGLE_NAME for n in head if not n.startswith(PAD_PREFIX)}
        elif storage.exists(self.path(INDEX_NAME)):
            self.index = INDEX_NAME
            self.weight_map = self._read_index()
        else:
            pickled = [n for n in PICKLED_NAMES if storage.exists(self.path(n))]
            if pickled:
                raise CheckpointNotFoundError(
                    f"{self.where} holds {pickled[0]}, transformers' legacy pickled weights, and no "
                    f"{SINGLE_NAME} nor {INDEX_NAME}; shardkeeper never unpickles a Hugging Face folder. "
                    f"Convert it to safetensors once, where you trust the files: "
                    f"AutoModel.from_pretrained(folder).save_pretrained(new_folder) (the model's own class), "
                    f"then pass new_folder"
                )
            raise CheckpointNotFoundError(
                f"{self.where} holds neither {SINGLE_NAME} nor {INDEX_NAME}, so it is not a Hugging Face "
                f"safetensors folder; pass the folder that holds them (in the Hub cache: the repository's "
                f"folder or its snapshots/<revision>)"
            )

    def path(self, file: str) -> str:
        return f"{self.dir}/{file}" if self.dir else file

    def describe(self, path: str) -> str:
        return f"{self.storage.describe(path)}{self._who}"

    def _read_index(self) -> dict[str, str]:
        path = self.path(INDEX_NAME)
        where = self.describe(path)
        size = self.storage.size(path)
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(f"{where} is {size} bytes, more than an index can be; {REMEDY}")
        try:
            doc = loads_untrusted(self.storage.read_bytes(path), max_bytes=MAX_INDEX_BYTES)
        except UntrustedJSONError as e:
            raise CorruptCheckpointError(f"{where} {e}; {REMEDY}") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise CorruptCheckpointError(f"{where} has no weight_map of tensor names to file names; {REMEDY}")
        odd = next(((n, f) for n, f in wm.items() if not isinstance(f, str)), None)
        if odd is not None:
            raise CorruptCheckpointError(
                f"{where}: its weight_map maps {odd[0]!r} to {odd[1]!r}, not a file name; {REMEDY}"
            )
        for file in set(wm.values()):
            if not safe_relative_path(file) or file.startswith(".."):
                raise CorruptCheckpointError(
                    f"{where} names the file {file!r}, which is not a path inside the folder; {REMEDY}"
                )
        return dict(wm)

    def _header(self, file: str) -> dict[str, Tensor]:
        got = self._headers.get(file)
        if got is not None:
            return got
        path = self.path(file)
        where = self.describe(path)
        try:
            size = self.storage.size(path)
        except CheckpointNotFoundError:
            if not self.index:
                raise
            held = sorted(n for n, f in self.weight_map.items() if f == file)
            raise CorruptCheckpointError(
                f"{self.describe(self.path(self.index))} names {file} for {len(held)} tensor(s) ({held[0]!r} ...), "
                f"which the folder lacks (a download cut short, or a shard deleted); {REMEDY}"
            ) from None
        if size < 8:
            raise CorruptCheckpointError(f"{where} is {size} bytes, too short for a safetensors header; {REMEDY}")
        (n,) = struct.unpack("<Q", self.storage.read_range(path, 0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptCheckpointError(
                f"{where}: the safetensors header length {n} does not fit the file ({size} bytes) or the "
                f"format's limit ({MAX_HEADER_BYTES}); {REMEDY}"
            )
        got = parse_header(self.storage.read_range(path, 8, n), file, 8 + n, size, where)
        self._headers[file] = got
        self.sizes[file] = size
        return got

    def tensors(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named tensors (names of ``weight_map``), each from its file's header."""
        out: dict[str, Tensor] = {}
        for name in names:
            file = self.weight_map[name]
            t = self._header(file).get(name)
            if t is None:
                raise CorruptCheckpointError(
                    f"{self.where}: {self.index} puts tensor {name!r} in {file}, whose header has no such "
                    f"tensor; {REMEDY}"
                )
            out[name] = t
        return out


def looks_like_hf(storage: Storage, dir: str = "") -> bool:
    """Whether ``dir`` holds a safetensors folder's single file or index."""
    base = f"{dir}/" if dir else ""
    return storage.exists(base + SINGLE_NAME) or storage.exists(base + INDEX_NAME)


__all__ = [
    "DTYPE_OF_CODE",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "REMEDY",
    "SINGLE_NAME",
    "Folder",
    "Tensor",
    "looks_like_hf",
    "parse_header",
]
