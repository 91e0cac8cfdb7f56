# SPDX-License-Identifier: MIT
"""AITER GEMM tuning tables: the CSV files AITER reads to pick a kernel for each GEMM shape.

Accepted: one of the headers AITER writes (HEADERS), a value in every column, numbers where numbers
belong (`nan` timings included: AITER writes them for shapes without a kernel), and no two rows with
one lookup key (cu_num,M,N,K[,q_dtype_w]): AITER keeps one kernel per key, silently shadowing the rest.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import UserError

HEADERS: dict[tuple[str, ...], str] = {
    tuple(
        [
            "gfx",
            "cu_num",
            "M",
            "N",
            "K",
            "libtype",
            "kernelId",
            "splitK",
            "us",
            "kernelName",
            "tflops",
            "bw",
            "errRatio",
        ]
    ): "current",
    tuple(
        ["gfx", "cu_num", "M", "N", "K", "kernelId", "splitK", "us", "kernelName", "tflops", "bw", "errRatio"]
    ): "with gfx",
    tuple(
        [
            "gfx",
            "cu_num",
            "M",
            "N",
            "K",
            "q_dtype_w",
            "kernelId",
            "splitK",
            "us",
            "kernelName",
            "tflops",
            "bw",
            "errRatio",
        ]
    ): "a8w8 rowwise",
    tuple(
        ["cu_num", "M", "N", "K", "kernelId", "splitK", "us", "kernelName", "tflops", "bw", "errRatio"]
    ): "with metrics",
    tuple(["cu_num", "M", "N", "K", "kernelId", "splitK", "us", "kernelName"]): "older",
}
KEY = ("cu_num", "M", "N", "K")
EXTRA_KEY = ("q_dtype_w",)
POSITIVE_INTS = ("cu_num", "M", "N", "K")
INTS = ("kernelId", "splitK")
FLOATS = ("us", "tflops", "bw", "errRatio")

_INT = re.compile(r"^-?[0-9]+\Z")
_FLOAT = re.compile(r"^-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?\Z")
_GFX = re.compile(r"^gfx[0-9a-f]{3,5}\Z")
_WORD = re.compile(r"^[A-Za-z0-9_.]+\Z")
_KERNEL = re.compile(r"^[A-Za-z0-9_.$-]+\Z")

MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class TuningTable:
    path: str
    header: str  # the name of the known column set
    rows: int
    gfx: tuple[str, ...]  # the gfx targets named, if the table has a gfx column
    cu_nums: tuple[int, ...]


def _err(where: str, message: str, hint: str) -> UserError:
    return UserError(f"{where}: {message}", hint=hint)


def validate(path: Path, name: str | None = None) -> TuningTable:
    """Check the table at PATH; UserError naming the file and line of the first fault."""
    shown = name or str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{shown}: missing", hint="supply the tuning table") from None
    return validate_bytes(data, shown)


def validate_bytes(data: bytes, name: str) -> TuningTable:
    if len(data) > MAX_BYTES:
        raise _err(name, f"{len(data)} bytes, more than a tuning table can be", "check the file")
    if data.startswith(b"\xef\xbb\xbf"):
        raise _err(
            f"{name}:1",
            "starts with a byte order mark",
            "save it as UTF-8 without a BOM (AITER would misread the first column)",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise _err(f"{name}:{line}", "not UTF-8", "save the table as UTF-8") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: tuple[str, ...] | None = None
    kind = ""
    seen: dict[tuple[str, ...], int] = {}
    gfx: set[str] = set()
    cu_nums: set[int] = set()
    rows = 0
    try:
        for record in reader:
            line = reader.line_num
            if not record or record == [""]:
                continue
            if header is None:
                header = tuple(record)
                if header not in HEADERS:
                    raise _err(
                        f"{name}:{line}",
                        f"header {','.join(record)!r} is not an AITER tuned-GEMM header",
                        "expected " + ",".join(next(iter(HEADERS))) + " (or an older AITER column set)",
                    )
                kind = HEADERS[header]
                continue
            if len(record) != len(header):
                raise _err(
                    f"{name}:{line}", f"{len(record)} fields, the header has {len(header)}", "one value per column"
                )
            row = dict(zip(header, record, strict=True))
            _check_row(row, f"{name}:{line}")
            key_columns = [c for c in KEY + EXTRA_KEY if c in row]
            key = tuple(str(int(row[c])) if c in KEY else row[c] for c in key_columns)
            if key in seen:
                cols = ",".join(key_columns)
                raise _err(
                    f"{name}:{line}",
                    f"duplicate row: {cols} = {','.join(key)} is already on line {seen[key]}",
                    "keep one row per shape (AITER would use only one of them)",
                )
            seen[key] = line
            rows += 1
            cu_nums.add(int(row["cu_num"]))
            if "gfx" in row:
                gfx.add(row["gfx"])
    except csv.Error as e:
        raise _err(f"{name}:{reader.line_num}", f"not valid CSV ({e})", "check the quoting on that line") from None
    if header is None:
        raise _err(name, "empty", "a tuning table has a header line and rows")
    if rows == 0:
        raise _err(name, "has a header but no rows", "a tuning table needs at least one row")
    return TuningTable(name, kind, rows, tuple(sorted(gfx)), tuple(sorted(cu_nums)))


def _check_row(row: dict[str, str], where: str) -> None:
    for column, value in row.items():
        if value != value.strip():
            raise _err(where, f"{column} = {value!r} has surrounding spaces", "write values without spaces")
    for column in POSITIVE_INTS:
        value = row[column]
        if not _INT.match(value) or int(value) <= 0:
            raise _err(where, f"{column} = {value!r} is not a positive integer", f"{column} is a whole number above 0")
    for column in INTS:
        value = row[column]
        if not _INT.match(value) or int(value) < -1:
            raise _err(
                where,
                f"{column} = {value!r} is not an integer",
                f"{column} is a whole number (kernelId -1: none found)",
            )
    for column in FLOATS:
        if column not in row:
            continue
        value = row[column]
        if value.lower() == "nan":
            continue
        if not _FLOAT.match(value) or not math.isfinite(float(value)) or float(value) < 0:
            raise _err(where, f"{column} = {value!r} is not a number", f"{column} is a number of 0 or more (or nan)")
    if "gfx" in row and not _GFX.match(row["gfx"]):
        raise _err(where, f"gfx = {row['gfx']!r} is not a GPU target", "e.g. gfx942 (MI300X) or gfx950")
    for column in ("libtype", "q_dtype_w"):
        if column in row and not _WORD.match(row[column]):
            raise _err(
                where, f"{column} = {row[column]!r} is not valid", f"{column} is a word such as ck, asm or torch.int8"
            )
    if not _KERNEL.match(row["kernelName"]):
        raise _err(
            where, f"kernelName = {row['kernelName']!r} is not a kernel name", "the tuner writes the kernel's name here"
        )


def validate_all(paths: Iterable[tuple[str, Path]]) -> list[TuningTable]:
    return [validate(path, name) for name, path in paths]


def problems(paths: Iterable[tuple[str, Path]]) -> list[UserError]:
    """What validate_all would refuse, for every table."""
    found: list[UserError] = []
    for name, path in paths:
        try:
            validate(path, name)
        except UserError as e:
            found.append(e)
    return found
