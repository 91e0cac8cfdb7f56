# SPDX-License-Identifier: MIT
"""SHA256SUMS and the pin check (builder/pins.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from repository import FIXTURES

from appliance.config import Config, load
from appliance.config.model import PinnedFile
from appliance.errors import ConfigError, UserError
from appliance.signed import sums
from builder import pins

REPO = Path(__file__).resolve().parents[1]
H1 = "a" * 64
H2 = "0123456789abcdef" * 4


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- reading like GNU


def test_text_and_binary_modes() -> None:
    e = sums.parse_sums(f"{H1}  a.txt\n{H2} *b.bin\n".encode())
    assert e["a.txt"].sha256 == H1 and not e["a.txt"].binary
    assert e["b.bin"].sha256 == H2 and e["b.bin"].binary


def test_leading_whitespace_is_skipped_like_the_reference_file() -> None:
    text = f"{H1}  compose.yaml\n {H2}  patches/x.py\n\t{H1}  tuning/t.csv\n"
    assert set(sums.parse_sums(text.encode())) == {"compose.yaml", "patches/x.py", "tuning/t.csv"}


def test_upper_case_hash_crlf_comments_and_blank_lines() -> None:
    text = f"# pins\r\n\r\n{H1.upper()}  a.txt\r\n   \n{H2}  b.txt"
    e = sums.parse_sums(text.encode())
    assert e["a.txt"].sha256 == H1 and e["a.txt"].line == 3
    assert e["b.txt"].line == 5


def test_names_keep_spaces_and_escapes() -> None:
    text = f"{H1}  name with spaces \n\\{H2}  back\\\\slash\\nnewline\n"
    e = sums.parse_sums(text.encode())
    assert "name with spaces " in e
    assert "back\\slash\nnewline" in e


def test_bsd_tag_and_one_space_forms() -> None:
    assert "a/b.py" in sums.parse_sums(f"SHA256 (a/b.py) = {H1}\n".encode())
    assert "c.py" in sums.parse_sums(f"{H1} c.py\n".encode())


def test_one_space_and_two_space_forms_do_not_mix() -> None:
    with pytest.raises(UserError, match=":2: improperly formatted"):
        sums.parse_sums(f"{H1}  a.py\n{H2} b.py\n".encode())


@pytest.mark.parametrize(
    "line",
    [
        "deadbeef  short.py",  # short hash
        f"{H1[:-1]}g  bad-hex.py",
        f"{H1}",  # no name
        f"{H1}x  glued.py",
        f"\\{H1}  bad\\escape",
        f"\\{H1}  trailing\\",
        "just some text",
        f"SHA256 (x.py) = {H1[:10]}",
    ],
)
def test_malformed_line_names_its_number(line: str) -> None:
    with pytest.raises(UserError, match=r"SHA256SUMS:2: improperly formatted") as info:
        sums.parse_sums(f"{H1}  ok.py\n{line}\n".encode())
    assert "\n" not in info.value.message and info.value.hint


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside", "a/../../b", "a//b", "./a"])
def test_names_must_stay_in_the_project(name: str) -> None:
    with pytest.raises(UserError, match=":1: "):
        sums.parse_sums(f"{H1}  {name}\n".encode())


def test_duplicate_name_is_refused() -> None:
    with pytest.raises(UserError, match=r":3: a.py is listed again \(first on line 1\)"):
        sums.parse_sums(f"{H1}  a.py\n{H2}  b.py\n{H2}  a.py\n".encode())


@pytest.mark.programs
@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="GNU sha256sum not installed")
def test_agrees_with_gnu_sha256sum(tmp_path: Path) -> None:
    names = ["plain.txt", "with space.txt", "back\\slash.txt", "new\nline.txt", "star*.bin"]
    lines = []
    for i, name in enumerate(names):
        data = f"content {i}\n".encode()
        (tmp_path / name).write_bytes(data)
        line = sums.format_line(name, sha(data))
        lines.append(("  " if i == 1 else "") + line)  # one indented line, as in the reference file
    text = "\n".join(lines) + "\n"
    (tmp_path / "SUMS").write_text(text)
    proc = subprocess.run(["sha256sum", "--strict", "-c", "SUMS"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parsed = sums.parse_sums(text.encode())
    assert set(parsed) == set(names)
    assert all(parsed[n].sha256 == sha((tmp_path / n).read_bytes()) for n in names)


# ----------------------------------------------------------------------------- a project tree

OVERLAY = b"VARIANT = 'demo'\n"
DIFF = b"--- a/standin/answers.py\n+++ b/overlays/demo/standin_answers.py\n"
TABLE = (
    b"gfx,cu_num,M,N,K,libtype,kernelId,splitK,us,kernelName,tflops,bw,errRatio\n"
    b"gfx942,304,16,1536,4096,ck,7,0,10.4,k_a,19.3,615.7,0.0\n"
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "appliance.toml", root / "appliance.toml")
    demo = load(root / "appliance.toml", "demo")
    for f in demo.engine.overlays:
        write(root / f.file, OVERLAY)
        write(root / pins.diff_for(f.file), DIFF)
    for f in demo.engine.tuning:
        write(root / f.file, TABLE)
    write(root / "overlays/README.md", b"not pinned\n")
    write(root / pins.FIRMWARE_PINS, b"# none\n")
    pins.pin(root)
    return root


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def demo_config(root: Path) -> Config:
    return load(root / "appliance.toml", "demo")


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0x20
    path.write_bytes(bytes(data))


def test_demo_passes_without_production_files(repo: Path) -> None:
    arts = pins.check(demo_config(repo), repo)
    assert {a.kind for a in arts} == {"overlay", "diff", "tuning"}
    by_path = {a.path: a for a in arts}
    overlay = demo_config(repo).engine.overlays[0]
    assert by_path[overlay.file].sha256 == sha(OVERLAY)
    assert by_path[overlay.file].target == overlay.target
    # the production pins stay listed though their files are absent
    sums = pins.read_sums(repo)
    prod = load(repo / "appliance.toml", "production")
    for f in (*prod.engine.overlays, *prod.engine.tuning):
        assert sums[f.file].sha256 == f.sha256


def test_pin_writes_sorted_gnu_lines_atomically(repo: Path) -> None:
    lines = pins.pin(repo)
    names = [line.split("  ", 1)[1] for line in lines]
    assert names == sorted(names)
    assert (repo / "SHA256SUMS").read_text() == "".join(line + "\n" for line in lines)
    assert not [p for p in repo.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("which", ["overlay", "diff", "tuning"])
def test_flipped_byte_is_refused_with_both_hashes(repo: Path, which: str) -> None:
    config = demo_config(repo)
    rel = {
        "overlay": config.engine.overlays[0].file,
        "diff": pins.diff_for(config.engine.overlays[0].file),
        "tuning": config.engine.tuning[0].file,
    }[which]
    expected = sha((repo / rel).read_bytes())
    flip(repo / rel)
    actual = sha((repo / rel).read_bytes())
    with pytest.raises(UserError) as info:
        pins.check(config, repo)
    assert info.value.message == f"{rel}: changed: expected sha256 {expected}, actual {actual}"


def test_missing_file_is_refused(repo: Path) -> None:
    rel = demo_config(repo).engine.tuning[0].file
    (repo / rel).unlink()
    with pytest.raises(UserError, match=f"{rel}: missing: expected sha256 [0-9a-f]{{64}}, actual none"):
        pins.check(demo_config(repo), repo)


@pytest.mark.parametrize("rel", ["overlays/demo/extra.py", "tuning/production/stale.csv", "overlays/diffs/other.patch"])
def test_unlisted_file_is_refused(repo: Path, rel: str) -> None:
    write(repo / rel, b"x\n")
    with pytest.raises(UserError, match=f"{rel}: unlisted"):
        pins.check(demo_config(repo), repo)


def test_pycache_is_not_a_pinned_file(repo: Path) -> None:
    write(repo / "overlays/demo/__pycache__/standin_answers.cpython-311.pyc", b"\0")
    pins.check(demo_config(repo), repo)


def test_symlink_leaving_its_directory_is_refused(repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_bytes(OVERLAY)  # same content: only the link is wrong
    rel = demo_config(repo).engine.overlays[0].file
    (repo / rel).unlink()
    (repo / rel).symlink_to(outside)
    with pytest.raises(UserError, match=f"{rel}: symlink to .* leaves its directory"):
        pins.check(demo_config(repo), repo)


def test_symlink_to_a_sibling_directory_is_refused(repo: Path) -> None:
    rel = demo_config(repo).engine.tuning[0].file
    write(repo / "tuning/production/elsewhere.csv", TABLE)
    (repo / rel).unlink()
    os.symlink("../production/elsewhere.csv", repo / rel)
    with pytest.raises(UserError, match="leaves its directory"):
        pins.check(demo_config(repo), repo)


def test_symlink_within_its_directory_is_allowed(repo: Path) -> None:
    rel = demo_config(repo).engine.overlays[0].file
    real = Path(rel).with_name("real_answers.py")
    os.replace(repo / rel, repo / real)
    os.symlink(real.name, repo / rel)
    pins.pin(repo)
    pins.check(demo_config(repo), repo)


def test_symlinked_pinned_directory_is_refused(repo: Path, tmp_path: Path) -> None:
    shutil.rmtree(repo / "overlays/diffs")
    (tmp_path / "ext").mkdir()
    (repo / "overlays/diffs").symlink_to(tmp_path / "ext")
    with pytest.raises(UserError, match="symlink"):
        pins.check(demo_config(repo), repo)


def with_files(
    config: Config, overlays: tuple[PinnedFile, ...] | None = None, tuning: tuple[PinnedFile, ...] | None = None
) -> Config:
    engine = dataclasses.replace(
        config.engine,
        overlays=config.engine.overlays if overlays is None else overlays,
        tuning=config.engine.tuning if tuning is None else tuning,
    )
    return dataclasses.replace(config, engine=engine)


def test_toml_pin_disagreeing_with_sha256sums_is_refused(repo: Path) -> None:
    config = demo_config(repo)
    f = config.engine.tuning[0]
    config = with_files(config, tuning=(dataclasses.replace(f, sha256=H1),))
    with pytest.raises(UserError, match=f"{f.file}: appliance.toml pins sha256 {H1} but SHA256SUMS line [0-9]+ has"):
        pins.check(config, repo)


def test_toml_pin_agreeing_passes(repo: Path) -> None:
    config = demo_config(repo)
    f = config.engine.tuning[0]
    config = with_files(config, tuning=(dataclasses.replace(f, sha256=sha(TABLE)),))
    pins.check(config, repo)


def test_file_used_but_not_listed_is_refused(repo: Path) -> None:
    write(repo / "standin/answers.py", b"x\n")
    config = with_files(demo_config(repo), overlays=(PinnedFile("standin/answers.py", "/opt/x.py"),))
    with pytest.raises(UserError, match=r"standin/answers.py: unlisted"):
        pins.check(config, repo)


def test_production_refuses_a_wrong_third_party_file(repo: Path) -> None:
    prod = load(repo / "appliance.toml", "production")
    f = prod.engine.overlays[0]
    write(repo / f.file, b"not the pinned overlay\n")
    with pytest.raises(UserError, match=f"{f.file}: changed: expected sha256 {f.sha256}, actual"):
        pins.check(prod, repo)


def test_pin_refuses_a_file_that_disagrees_with_appliance_toml(repo: Path) -> None:
    prod = load(repo / "appliance.toml", "production")
    f = prod.engine.overlays[0]
    write(repo / f.file, b"not the pinned overlay\n")
    before = (repo / "SHA256SUMS").read_bytes()
    with pytest.raises(UserError, match=r"appliance.toml pins"):
        pins.pin(repo)
    assert (repo / "SHA256SUMS").read_bytes() == before


def test_production_passes_with_the_real_tables(repo: Path) -> None:
    fixtures = FIXTURES / "tuning"
    prod = load(repo / "appliance.toml", "production")
    for f in prod.engine.tuning:
        (repo / f.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fixtures / Path(f.file).name, repo / f.file)
    # the overlays are third-party code not available here: check the tables alone
    arts = pins.check(with_files(prod, overlays=()), repo)
    assert {(a.path, a.sha256) for a in arts} == {(f.file, f.sha256) for f in prod.engine.tuning}


def test_firmware_pins(repo: Path) -> None:
    blob = b"\x7fpsp firmware"
    write(repo / "firmware/amdgpu/psp_13_0_6_sos.bin", blob)
    config = demo_config(repo)
    with pytest.raises(UserError, match=r"firmware/amdgpu/psp_13_0_6_sos.bin: unlisted"):
        pins.check(config, repo)
    write(repo / pins.FIRMWARE_PINS, f"{sha(blob)}  psp_13_0_6_sos.bin\n".encode())
    pins.pin(repo)
    arts = pins.check(config, repo)
    fw = [a for a in arts if a.kind == "firmware"]
    assert fw == [
        pins.PinnedArtifact(
            "firmware/amdgpu/psp_13_0_6_sos.bin",
            sha(blob),
            "/usr/lib/firmware/updates/amdgpu/psp_13_0_6_sos.bin",
            "firmware",
        )
    ]
    flip(repo / "firmware/amdgpu/psp_13_0_6_sos.bin")
    with pytest.raises(UserError, match=r"psp_13_0_6_sos.bin: changed"):
        pins.check(config, repo)


def test_firmware_pin_list_disagreeing_is_refused(repo: Path) -> None:
    blob = b"blob"
    write(repo / "firmware/amdgpu/x.bin", blob)
    write(repo / pins.FIRMWARE_PINS, f"{sha(blob)}  x.bin\n".encode())
    pins.pin(repo)
    write(repo / pins.FIRMWARE_PINS, f"{H1}  x.bin\n".encode())
    with pytest.raises(UserError, match=f"amdgpu.sha256 pins sha256 {H1}"):
        pins.check(demo_config(repo), repo)


def test_firmware_pin_list_names_must_be_plain(repo: Path) -> None:
    write(repo / pins.FIRMWARE_PINS, f"{H1}  ../../etc/x.bin\n".encode())
    with pytest.raises(UserError, match=r"amdgpu.sha256:1"):
        pins.check(demo_config(repo), repo)


def test_missing_sha256sums(repo: Path) -> None:
    (repo / "SHA256SUMS").unlink()
    with pytest.raises(UserError, match="SHA256SUMS: missing"):
        pins.check(demo_config(repo), repo)


def test_the_committed_sha256sums_covers_the_demo() -> None:
    arts = pins.check(load(REPO / "appliance.toml", "demo"), REPO)
    assert {a.kind for a in arts} >= {"overlay", "tuning"}


# ----------------------------------------------------------------------------- overlay targets


@pytest.mark.parametrize("target", ["relative/path.py", "/opt/../etc/passwd", "/opt/a b.py", ""])
def test_overlay_target_must_be_absolute_and_stay_put(tmp_path: Path, target: str) -> None:
    text = (REPO / "appliance.toml").read_text()
    text = text.replace('target = "/opt/standin/standin/answers.py"', f'target = "{target}"')
    assert f'target = "{target}"' in text
    (tmp_path / "appliance.toml").write_text(text)
    with pytest.raises(ConfigError, match="target"):
        load(tmp_path / "appliance.toml", "demo")


@pytest.mark.parametrize("file", ["../outside.py", "/etc/passwd"])
def test_overlay_file_must_stay_in_the_project(tmp_path: Path, file: str) -> None:
    text = (REPO / "appliance.toml").read_text()
    text = text.replace('file = "overlays/demo/standin_answers.py"', f'file = "{file}"')
    (tmp_path / "appliance.toml").write_text(text)
    with pytest.raises(ConfigError, match="file"):
        load(tmp_path / "appliance.toml", "demo")
