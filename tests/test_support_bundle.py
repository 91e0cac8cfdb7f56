# SPDX-License-Identifier: MIT
"""`applianctl support-bundle`: one tarball with the journal, status, slots, unit states and a
hardware inventory, every secret redacted, a failing source named rather than fatal, and nothing
left half-written."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakeprog import calls, fake_program

from appliance.errors import UserError
from applianctl.support_bundle import tarball

RECOVERY = "cbdefghi-jklnrtuv-cbdefghi-jklnrtuv-cbdefghi-jklnrtuv-cbdefghi-jklnrtuv"
PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n-----END PRIVATE KEY-----"
SECRETS = [RECOVERY, "hf_abcdefghijklmnopqrstuvwxyz123456", "sk-proj-abcdefghijklmnop1234", "s3cr3t-pass", "eyJhbGciOiJIUzI1NiJ9.tok",
           "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"]
JOURNAL = (f"Dec 02 appliance-var-seal: recovery key {RECOVERY}\n"
           "Dec 02 engine: HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz123456 OPENAI_API_KEY=sk-proj-abcdefghijklmnop1234\n"
           'Dec 02 host: {"password": "s3cr3t-pass"} Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.tok\n'
           f"Dec 02 tls: wrote\n{PEM}\nDec 02 engine: ready on 127.0.0.1:8000\n")


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    fake_program(bin_dir, "journalctl", stdout=JOURNAL)
    fake_program(bin_dir, "applianctl", script_body='case "$1" in status) echo \'{"state": "ok"}\';; slots) echo \'{"slots": []}\';; '
                                                    "verify) echo '{}'; exit 1;; esac")
    fake_program(bin_dir, "systemctl", stdout="appliance-engine.service loaded active running\n")
    fake_program(bin_dir, "amd-smi", stdout="", exit=1, script_body="echo 'amd-smi: no GPU found' >&2")
    fake_program(bin_dir, "lsblk", stdout='{"blockdevices": []}')
    fake_program(bin_dir, "ip", stdout="[]")
    monkeypatch.setenv("PATH", str(bin_dir))  # the fakes only: a tool that is missing here is missing
    return bin_dir


def _bundle(tools: Path, tmp_path: Path, since: str = "2 hours ago") -> tuple[dict[str, str], Path]:
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"version": "1.0.0"}')
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    path = tarball.write(tarball.gather(since, files=(("manifest.json", manifest), ("startup-report.json", tmp_path / "none"))), out)
    with tarfile.open(path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
    return members, path


def test_the_bundle_holds_every_source_and_no_secret(tools: Path, tmp_path: Path) -> None:
    members, path = _bundle(tools, tmp_path)
    assert path.name.startswith("support-") and path.name.endswith(".tar.gz") and path.stat().st_mode & 0o077 == 0
    assert {"journal.txt", "status.json", "slots.json", "verify.json", "units.txt", "hardware/lsblk.json", "hardware/ip-addr.json",
            "manifest.json", "index.json"} <= set(members)
    everything = "\n".join(members.values())
    for secret in SECRETS:
        assert secret not in everything, secret
    assert "ready on 127.0.0.1:8000" in members["journal.txt"] and tarball.REDACTED in members["journal.txt"]
    assert json.loads(members["status.json"]) == {"state": "ok"}
    assert ["journalctl", "--since", "2 hours ago", "-o", "short-iso-precise", "--no-pager"] in calls(tools / "calls.log")


def test_a_source_that_fails_is_named_with_why_and_the_rest_is_gathered(tools: Path, tmp_path: Path) -> None:
    members, _ = _bundle(tools, tmp_path)
    index = json.loads(members["index.json"])["sources"]
    assert index["hardware/amd-smi-static.json"]["exit"] == 1 and "no GPU found" in index["hardware/amd-smi-static.json"]["stderr"]
    assert index["verify.json"]["exit"] == 1  # verify's answer is its output and exit status, kept as they are
    assert index["startup-report.json"]["collected"] is False and "No such file" in index["startup-report.json"]["why"]
    (tools / "ip").unlink()
    members, _ = _bundle(tools, tmp_path)
    assert json.loads(members["index.json"])["sources"]["hardware/ip-addr.json"]["why"] == "ip is not installed"


def test_a_bundle_that_cannot_be_written_leaves_nothing_behind(tools: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    gathered = tarball.gather("1 day ago", commands=(), files=())
    gathered.files["big"] = b"x" * 1000

    def disk_full(self: object, *args: object, **kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tarball.tarfile.TarFile, "addfile", disk_full)
    with pytest.raises(UserError, match=r"cannot be written \(No space left on device\)"):
        tarball.write(gathered, out)
    assert list(out.iterdir()) == []


def test_bad_options_are_one_line_and_exit_2(tools: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        tarball.run(argparse.Namespace(since="1 day ago", output=str(tmp_path / "missing")))
    with pytest.raises(UserError, match="--since needs a time"):
        tarball.run(argparse.Namespace(since="x\nExecStart=", output=str(tmp_path)))


def test_redaction_keeps_what_is_not_a_secret() -> None:
    text = "engine ready; version 1.0.0; digest sha256:" + "ab" * 32 + "; token bucket refilled; recovery key shown once"
    assert tarball.redact(text) == text


SHADOW = "root:$6$saltsalt$Zm9vYmFyYmF6cXV4aGFzaGVkcGFzc3dvcmQ:19000:0:99999:7:::\n"


@pytest.fixture
def no_hang() -> Iterator[None]:
    """A test that would block (opening a FIFO that has no writer) fails after a few seconds instead."""
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("blocked")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_link_a_fifo_and_a_directory_are_skipped_and_named(tools: Path, tmp_path: Path, no_hang: None) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_text(SHADOW)
    (tmp_path / "link.json").symlink_to(shadow)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    files = (("startup-report.json", tmp_path / "link.json"), ("manifest.json", tmp_path / "fifo.json"),
             ("dir.json", tmp_path / "dir.json"))
    path = tarball.write(tarball.gather("1 day ago", commands=(), files=files), out)
    with tarfile.open(path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert set(members) == {"journal.txt", "index.json"}
    assert "saltsalt" not in "".join(members.values())
    sources = json.loads(members["index.json"])["sources"]
    assert sources["startup-report.json"] == {"file": str(tmp_path / "link.json"), "collected": False,
                                              "why": "a symbolic link, not followed: skipped"}
    assert sources["manifest.json"]["why"] == "a FIFO, not a regular file: skipped"
    assert sources["dir.json"]["why"] == "a directory, not a regular file: skipped"


@pytest.mark.programs
def test_a_file_larger_than_the_limit_is_cut_at_a_whole_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarball, "MAX_SOURCE_BYTES", 20)
    big = tmp_path / "big.json"
    big.write_text("line one\nline two\nDB_PASSWORD=hunter2\n")
    gathered = tarball.gather("1 day ago", commands=(), files=(("big.json", big),))
    assert gathered.files["big.json"] == b"line one\nline two\n"
    assert gathered.index["sources"]["big.json"]["cut_to_first_bytes"] == 20


def test_the_tarball_is_its_owners_alone_from_its_first_byte(tools: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    seen: list[int] = []
    addfile = tarball.tarfile.TarFile.addfile

    def watching(self: tarfile.TarFile, *args: Any, **kw: Any) -> None:
        seen.extend(p.stat().st_mode & 0o777 for p in out.iterdir())
        addfile(self, *args, **kw)

    monkeypatch.setattr(tarball.tarfile.TarFile, "addfile", watching)
    old = os.umask(0o022)
    try:
        path = tarball.write(tarball.gather("1 day ago", commands=(), files=()), out)
    finally:
        os.umask(old)
    assert seen and set(seen) == {0o600}
    assert path.stat().st_mode & 0o777 == 0o600 and list(out.iterdir()) == [path]


PRIVATE = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw"
FAMILIES = {  # a line that plants a secret: the secret
    "DB_PASSWORD=correct horse battery staple": "correct horse battery staple",
    'AWS_SECRET_ACCESS_KEY="wJalrXUtnFEMI/K7MDENG bPxRfiCY"': "wJalrXUtnFEMI/K7MDENG bPxRfiCY",
    "GITHUB_TOKEN: gh-not-a-known-format-zz9": "gh-not-a-known-format-zz9",
    'config {"db_password": "pa ss \\" w0rdX", "host": "db1"}': "pa ss",
    "fetch https://alice:Sup3rS3cret@mirror.example/weights": "Sup3rS3cret",
    "vllm serve --password hunter22 --api-key=k3y-v4lue --token 'two words'": "hunter22",
    "again --api-key=k3y-v4lue": "k3y-v4lue",
    "and --token 'two words'": "two words",
    "> Cookie: session=c00kieValue; theme=dark": "c00kieValue",
    "< Set-Cookie: sid=setC00kie; Path=/": "setC00kie",
    "> Authorization: Basic dXNlcjpwYXNzd29yZA==": "dXNlcjpwYXNzd29yZA==",
    "> Proxy-Authorization: Digest username=proxyPW123": "proxyPW123",
    f"-----BEGIN EC PRIVATE KEY-----\n{PRIVATE}\n-----END EC PRIVATE KEY-----": PRIVATE,
}


def test_every_family_of_secret_is_absent_from_every_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = "\n".join(FAMILIES) + "\nDec 02 engine: ready on 127.0.0.1:8000\n"
    bin_dir = tmp_path / "bin"
    fake_program(bin_dir, "journalctl", stdout=planted)
    fake_program(bin_dir, "applianctl", stdout=json.dumps({"state": "ok", "log": planted, "argv": ["vllm", "--api-key", "argvS3cret"],
                                                           "var_recovery_key": True, "hf_token": "plainH4sh"}))
    fake_program(bin_dir, "systemctl", stdout=planted, exit=3, script_body=f"printf '%s' {shlex.quote(planted)} >&2")
    monkeypatch.setenv("PATH", str(bin_dir))
    report = tmp_path / "startup-report.json"
    report.write_text(planted)
    out = tmp_path / "out"
    out.mkdir()
    path = tarball.write(tarball.gather("1 day ago", commands=(("status.json", ("applianctl", "status", "--json")),
                                                               ("units.txt", ("systemctl", "list-units"))),
                                        files=(("startup-report.json", report),)), out)
    with tarfile.open(path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert set(members) == {"journal.txt", "status.json", "units.txt", "startup-report.json", "index.json"}
    for member, text in members.items():
        for secret in [*FAMILIES.values(), "argvS3cret", "plainH4sh", "w0rdX"]:
            assert secret not in text, (member, secret)
        if member != "index.json":
            assert "ready on 127.0.0.1:8000" in text and "https://alice:" in text and "db1" in text, member
    status = json.loads(members["status.json"])  # redacted by its keys: still JSON, its flags kept
    assert status["var_recovery_key"] is True and status["hf_token"] == tarball.REDACTED and status["state"] == "ok"
    assert "Path=/" not in members["units.txt"]  # a cookie's line is all cookie


def test_a_private_key_cut_by_the_tail_limit_is_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"-----BEGIN PRIVATE KEY-----\n{PRIVATE}\n{PRIVATE[::-1]}\n-----END PRIVATE KEY-----\n"
    bin_dir = tmp_path / "bin"
    fake_program(bin_dir, "journalctl", stdout=f"early\n{key}late line\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(tarball, "MAX_SOURCE_BYTES", len(key) - 10)  # the BEGIN and the first line are cut off
    out = tmp_path / "out"
    out.mkdir()
    gathered = tarball.gather("1 day ago", commands=(), files=())
    assert "BEGIN" not in gathered.files["journal.txt"].decode() and PRIVATE[::-1] in gathered.files["journal.txt"].decode()
    with tarfile.open(tarball.write(gathered, out)) as tar:
        journal = next(tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith("journal.txt"))  # type: ignore[union-attr]
    assert PRIVATE[::-1] not in journal and journal.endswith("late line\n")


def test_a_line_cut_at_its_start_by_the_tail_limit_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    fake_program(bin_dir, "journalctl", stdout="early\nengine: DB_PASSWORD=s3cretvalue\nlate line\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(tarball, "MAX_SOURCE_BYTES", len("WORD=s3cretvalue\nlate line\n"))  # the name is cut off, not its value
    gathered = tarball.gather("1 day ago", commands=(), files=())
    assert gathered.files["journal.txt"] == b"late line\n"
    assert gathered.index["sources"]["journal.txt"]["cut_to_last_bytes"] == tarball.MAX_SOURCE_BYTES
