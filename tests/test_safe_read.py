# SPDX-License-Identifier: MIT
"""Files someone else could have written (the install plan and its signature, the device's records,
the per-host settings, staged bundle files): a FIFO, a link to /dev/zero, a link to a real file, a
directory, a 1 GiB sparse file, 10 000 nested brackets or a 5 000-digit number is refused in one
line, at once; a regular file reads exactly as before."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from appliance import config, host_settings, safe_read
from appliance.errors import ConfigError, UserError
from appliance.schema import load_record
from appliance.signed import install_plan, release_manifest
from applianctl import host
from applianctl.records import HostResult, VerifyResult
from applianctl.status.files import probe_check
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED
from builder import keys

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(20)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _link_to_real_file(path: Path) -> None:
    real = path.with_name(path.name + ".real")
    real.write_text('{"ok": true, "reason": ""}\n')
    path.symlink_to(real)


def _directory(path: Path) -> None:
    path.mkdir()


def _sparse_gib(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # no block written


def _deep(path: Path) -> None:
    path.write_text("[" * 10_000 + "]" * 10_000)


def _long_number(path: Path) -> None:
    path.write_text('{"ok": true, "reason": "", "n": ' + "7" * 5000 + "}")


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "symlink to /dev/zero": (_dev_zero, "is a symbolic link"),
    "symlink to a real file": (_link_to_real_file, "is a symbolic link"),
    "directory": (_directory, "is a directory, not a regular file"),
    "1 GiB sparse file": (_sparse_gib, f"{1 << 30} bytes, more than"),
    "deep nesting": (_deep, "nested deeper than 32 levels"),
    "5000-digit number": (_long_number, "a number of 5000 digits, more than 20"),
}
FILE_FAULTS = [k for k in HOSTILE if k not in ("deep nesting", "5000-digit number")]


def _one_line(e: UserError) -> None:
    assert "\n" not in e.message and e.hint and "\n" not in e.hint


# --------------------------------------------------------------------------- the helper


def test_a_regular_file_reads_whole_and_a_missing_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert safe_read.read_capped(path, 10, what="a file") is None
    path.write_bytes(b"0123456789")
    assert safe_read.read_capped(path, 10, what="a file") == b"0123456789"
    with pytest.raises(UserError, match="10 bytes, more than 9"):
        safe_read.read_capped(path, 9, what="a file")


def test_a_file_that_grows_while_read_is_refused_at_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    real_fstat = os.fstat

    def small(fd: int) -> os.stat_result:  # the size as it was before the file grew
        st = list(real_fstat(fd))
        st[6] = 5
        return os.stat_result(st)

    monkeypatch.setattr(safe_read.os, "fstat", small)
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(safe_read.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(UserError, match="grew past 10 bytes"):
        safe_read.read_capped(path, 10, what="a file")
    assert sum(reads) <= 11


def test_json_within_the_bounds_reads_as_json_loads_reads_it() -> None:
    text = '{"inode": 18446744073709551615, "neg": -18446744073709551615, "f": 0.1, "e": 1e-300, "n": NaN, "s": "[[[["}'
    value = safe_read.loads_bounded(text)
    assert value["inode"] == 2**64 - 1 and value["neg"] == -(2**64 - 1) and value["f"] == 0.1 and value["s"] == "[[[["
    assert safe_read.loads_bounded("[" * 32 + "]" * 32) is not None
    with pytest.raises(safe_read.JSONBoundError, match="nested deeper than 32"):
        safe_read.loads_bounded("[" * 33 + "]" * 33)
    with pytest.raises(safe_read.JSONBoundError, match="21 digits"):
        safe_read.loads_bounded("1" * 21)
    with pytest.raises(safe_read.JSONBoundError, match="characters, more than 40"):
        safe_read.loads_bounded("0." + "1" * 40)


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize("fault", list(HOSTILE))
def test_a_hostile_record_is_refused_in_one_line(tmp_path: Path, fault: str) -> None:
    make, words = HOSTILE[fault]
    path = tmp_path / "verify.json"
    make(path)
    with pytest.raises(UserError, match=re.escape(words)) as e:
        load_record(VerifyResult, path, lenient=True)
    _one_line(e.value)


@pytest.mark.parametrize("fault", list(HOSTILE))
def test_status_shows_a_hostile_result_file_as_degraded(tmp_path: Path, fault: str) -> None:
    make, _ = HOSTILE[fault]
    path = tmp_path / "verify.json"
    make(path)
    part = probe_check(path, "verify", VerifyResult)
    assert part.state == DEGRADED and "\n" not in part.reason
    assert probe_check(tmp_path / "absent.json", "verify", VerifyResult).state == NOT_CONFIGURED


# --------------------------------------------------------------------------- the install plan


@pytest.fixture
def trusted(tmp_path: Path) -> Path:
    _, public = keys.generate(tmp_path / "keys")
    directory = tmp_path / "trusted"
    directory.mkdir()
    shutil.copy(public, directory / "release.pub")
    return directory


@pytest.mark.parametrize("name", [install_plan.PLAN_JSON, install_plan.PLAN_SIG])
@pytest.mark.parametrize("fault", list(HOSTILE))
def test_a_hostile_plan_is_refused_in_one_line_and_the_defaults_stay(tmp_path: Path, trusted: Path, fault: str, name: str) -> None:
    make, words = HOSTILE[fault]
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    other = install_plan.PLAN_SIG if name == install_plan.PLAN_JSON else install_plan.PLAN_JSON
    (host_dir / other).write_bytes(release_manifest.encode_signature(bytes(64)) if other == install_plan.PLAN_SIG else b"{}")
    make(host_dir / name)
    with pytest.raises(install_plan.PlanRefused) as e:
        install_plan.load_signed(host_dir, trusted)
    _one_line(e.value)
    if fault in FILE_FAULTS:
        assert words in e.value.message
    else:  # the content is judged only once the signature holds: these bytes are signed by no key
        assert re.search(r"not signed by a key this release trusts|signature is malformed|more than 4096", e.value.message)
    result = tmp_path / "host.json"
    doc = host.apply(config.load(REPO / "appliance.toml", "demo"), host_dir, tmp_path / "net", result, trusted,
                     set_hostname=False)
    assert doc.ok is False and doc.reason.startswith("plan refused: ") and doc.source == "image defaults"
    assert load_record(HostResult, result, lenient=True) == doc


def test_a_link_where_the_plan_would_be_is_refused_not_ignored(tmp_path: Path, trusted: Path) -> None:
    """Before, a dangling link read as "no plan"; now the link itself is the fault."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / install_plan.PLAN_JSON).symlink_to(tmp_path / "nowhere")
    with pytest.raises(install_plan.PlanRefused, match="is a symbolic link"):
        install_plan.load_signed(host_dir, trusted)
    (host_dir / install_plan.PLAN_JSON).unlink()
    assert install_plan.load_signed(host_dir, trusted) is None


@pytest.mark.parametrize("body", [b"[" * 10_000 + b"]" * 10_000, b"7" * 5000])
def test_a_signed_form_too_deep_or_too_long_is_refused_by_the_parser(body: bytes) -> None:
    with pytest.raises(release_manifest.ManifestError, match=r"nested deeper than 32|5000 digits") as e:
        release_manifest.parse_canonical(body)
    _one_line(e.value)


# --------------------------------------------------------------------------- per-host settings


@pytest.mark.parametrize("fault", list(HOSTILE))
def test_hostile_host_settings_are_refused_in_one_line(appliance_json: Callable[[str], Path], tmp_path: Path, fault: str) -> None:
    make, words = HOSTILE[fault]
    path = tmp_path / "host-settings.json"
    make(path)
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        host_settings.load_device(appliance_json("demo"), path)
    _one_line(e.value)


# --------------------------------------------------------------------------- units


def test_every_oneshot_that_runs_applianctl_has_a_start_timeout() -> None:
    """A oneshot has no start timeout unless it sets one: a stuck read would hold the boot."""
    missing = []
    for unit in sorted((REPO / "units").glob("*.service*")):
        text = unit.read_text()
        runs_applianctl = re.search(r"^ExecStart=\S*(applianctl|python3 -m applianctl)", text, re.M)
        if "Type=oneshot" in text and runs_applianctl and not re.search(r"^TimeoutStartSec=", text, re.M):
            missing.append(unit.name)
    assert missing == []


# --------------------------------------------------------------------------- staged bundle files


@pytest.mark.parametrize("fault", FILE_FAULTS)
def test_a_hostile_staged_release_manifest_is_refused_in_one_line(tmp_path: Path, fault: str) -> None:
    from types import SimpleNamespace

    from appliance.errors import Refused
    from appliance.signed.bundle_index import payload_names
    from applianctl.update.checks import check_staged

    make, words = HOSTILE[fault]
    index: Any = SimpleNamespace(version="2.0.0", engine_digest="", manifest_sha256="0" * 64)
    names = payload_names(index.version, index.engine_digest, False)
    (tmp_path / names["manifest-sig"]).write_bytes(release_manifest.encode_signature(bytes(64)))
    make(tmp_path / names["manifest"])
    with pytest.raises(Refused, match=re.escape(words)) as e:
        check_staged(index, tmp_path, tmp_path)
    _one_line(e.value)


# ------------------------------------------------------------------------- a record's place made free


def test_what_is_no_regular_file_in_a_records_place_is_moved_aside(tmp_path: Path) -> None:
    """A directory in a record's place fails every atomic write onto it (rename onto a directory):
    it is renamed aside so the record's writer can write again; a regular file or nothing stays."""
    record = tmp_path / "boots.json"
    assert safe_read.set_aside(record) is None
    record.write_text("{damaged")
    assert safe_read.set_aside(record) is None and record.read_text() == "{damaged"  # a write replaces it
    record.unlink()
    aside = tmp_path / "boots.json.damaged"
    (aside / "older").mkdir(parents=True)  # what an earlier damage left
    record.mkdir()
    (record / "inside").write_text("x")
    assert safe_read.set_aside(record) == "a directory"
    assert not record.exists() and (aside / "inside").read_text() == "x" and not (aside / "older").exists()
    os.mkfifo(record)
    assert safe_read.set_aside(record) == "a FIFO" and not record.exists() and not (aside / "inside").exists()


def test_a_link_in_a_records_place_is_moved_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("keep")
    record = tmp_path / "boots.json"
    (tmp_path / "boots.json.damaged").symlink_to(target)  # an earlier aside that is a link: the link goes
    record.symlink_to(target)
    assert safe_read.set_aside(record) == "a symbolic link"
    assert (tmp_path / "boots.json.damaged").is_symlink() and (target / "precious").read_text() == "keep"
    assert not os.path.lexists(record)
