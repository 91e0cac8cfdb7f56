# SPDX-License-Identifier: MIT
"""AITER tuning table validation (builder/tuning.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from repository import FIXTURES

from appliance.config import load
from appliance.errors import UserError
from builder import tuning

REPO = Path(__file__).resolve().parents[1]
HEADER = "gfx,cu_num,M,N,K,libtype,kernelId,splitK,us,kernelName,tflops,bw,errRatio"
ROW = "gfx942,304,16,1536,4096,ck,7,0,10.4047,a8w8_blockscale_bpreshuffle_1x128x128_256x16x64x256,19.35,615.7,0.0"


def table(*rows: str, header: str = HEADER) -> bytes:
    return ("\n".join((header, *rows)) + "\n").encode()


def production_tables() -> list[tuple[Path, str]]:
    """(fixture path, appliance.toml pin) for the production profile's tables."""
    config = load(REPO / "appliance.toml", "production")
    return [(FIXTURES / "tuning" / Path(f.file).name, f.sha256) for f in config.engine.tuning]


def test_real_production_tables_pass_and_match_their_pins() -> None:
    tables = production_tables()
    assert len(tables) == 2
    for path, pin in tables:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == pin, path.name
        result = tuning.validate(path)
        assert result.header == "current"
        assert "gfx942" in result.gfx and 304 in result.cu_nums


def test_real_table_with_gfx950_rows() -> None:
    path = FIXTURES / "tuning" / "dsv4-a8w8-blockscale-tuned-gemm.mi300x.prefill-m2688.csv"
    result = tuning.validate(path)
    assert result.gfx == ("gfx942", "gfx950")
    assert result.cu_nums == (256, 304)


def test_demo_table_passes() -> None:
    config = load(REPO / "appliance.toml", "demo")
    for f in config.engine.tuning:
        result = tuning.validate(REPO / f.file)
        assert result.header == "current" and result.rows >= 3


@pytest.mark.parametrize(
    "header",
    [
        HEADER,
        "gfx,cu_num,M,N,K,kernelId,splitK,us,kernelName,tflops,bw,errRatio",
        "cu_num,M,N,K,kernelId,splitK,us,kernelName,tflops,bw,errRatio",
        "cu_num,M,N,K,kernelId,splitK,us,kernelName",
    ],
)
def test_known_headers(header: str) -> None:
    columns = header.split(",")
    values = dict(zip(HEADER.split(","), ROW.split(","), strict=True))
    row = ",".join(values[c] for c in columns)
    assert tuning.validate_bytes(table(row, header=header), "t.csv").rows == 1


def test_rowwise_header_keys_on_dtype() -> None:
    header = "gfx,cu_num,M,N,K,q_dtype_w,kernelId,splitK,us,kernelName,tflops,bw,errRatio"
    rows = (
        "gfx950,256,1,1280,8192,torch.int8,34,0,17.69,a8w8_rowwise_256x16x64x512,1.19,593.31,0.0",
        "gfx950,256,1,1280,8192,torch.float8_e4m3fn,79,3,7.67,a8w8_rowwise_128x16x32x128,2.73,1366.79,0.1344",
    )
    assert tuning.validate_bytes(table(*rows, header=header), "t.csv").rows == 2


def test_untuned_nan_rows_as_aiter_writes_them() -> None:
    rows = ("256,16,576,7168,-1,0,nan,None",)
    assert tuning.validate_bytes(table(*rows, header="cu_num,M,N,K,kernelId,splitK,us,kernelName"), "t.csv").rows == 1


def test_crlf_is_accepted() -> None:
    assert tuning.validate_bytes(table(ROW).replace(b"\n", b"\r\n"), "t.csv").rows == 1


def test_duplicate_row_is_refused_with_both_lines() -> None:
    other = ROW.replace("10.4047", "11.0")
    with pytest.raises(
        UserError, match=r"t.csv:4: duplicate row: cu_num,M,N,K = 304,16,1536,4096 is already on line 2"
    ):
        tuning.validate_bytes(table(ROW, ROW.replace(",16,", ",32,"), other), "t.csv")


def test_duplicate_with_a_different_gfx_is_still_a_duplicate() -> None:
    with pytest.raises(UserError, match="duplicate row"):
        tuning.validate_bytes(table(ROW, ROW.replace("gfx942", "gfx950")), "t.csv")


def test_duplicate_with_leading_zero_is_a_duplicate() -> None:
    with pytest.raises(UserError, match="duplicate row"):
        tuning.validate_bytes(table(ROW, ROW.replace(",1536,", ",01536,")), "t.csv")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (ROW.replace(",304,", ",x304,"), "cu_num"),
        (ROW.replace(",304,", ",0,"), "cu_num"),
        (ROW.replace(",4096,", ",4096.0,"), "K"),
        (ROW.replace(",7,0,", ",seven,0,"), "kernelId"),
        (ROW.replace(",7,0,", ",7,-2,"), "splitK"),
        (ROW.replace("10.4047", "fast"), "us"),
        (ROW.replace("10.4047", "inf"), "us"),
        (ROW.replace("615.7", "-1"), "bw"),
        (ROW.replace("gfx942", "mi300x"), "gfx"),
        (ROW.replace(",ck,", ",,"), "libtype"),
        (ROW.replace(",16,", ", 16,"), "spaces"),
        (ROW + ",extra", "fields"),
        (ROW.rsplit(",", 1)[0], "fields"),
    ],
)
def test_bad_values_are_refused_naming_the_line(bad: str, message: str) -> None:
    with pytest.raises(UserError, match=rf"t.csv:3: .*{message}"):
        tuning.validate_bytes(table(ROW.replace(",16,", ",64,"), bad), "t.csv")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        HEADER.encode() + b"\n",
        b"M,N,K,kernelName\n1,2,3,k\n",
        b"\xef\xbb\xbf" + table(ROW),
        table(ROW).replace(b"gfx942", b"gfx\xff42"),
    ],
)
def test_bad_tables_are_refused(data: bytes) -> None:
    with pytest.raises(UserError, match=r"t.csv"):
        tuning.validate_bytes(data, "t.csv")


def test_one_byte_flip_in_a_real_table_is_caught_by_its_pin(tmp_path: Path) -> None:
    path, pin = production_tables()[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    assert hashlib.sha256(bytes(data)).hexdigest() != pin


def test_validate_all_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "dup.csv").write_bytes(table(ROW, ROW))
    with pytest.raises(UserError, match=r"^tuning/x/dup.csv:3: duplicate row"):
        tuning.validate_all([("tuning/x/dup.csv", tmp_path / "dup.csv")])
