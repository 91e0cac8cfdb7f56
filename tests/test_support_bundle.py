"""`applianctl support-bundle`: one tarball with the journal, status, slots, unit states and a
hardware inventory, every secret redacted, a failing source named rather than fatal, and nothing
left half-written."""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

import pytest
from fakeprog import calls, fake_program

from appliance.errors import UserError
from applianctl.status import bundle as support

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
    path = support.write(support.gather(since, files=(("manifest.json", manifest), ("startup-report.json", tmp_path / "none"))), out)
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
    assert "ready on 127.0.0.1:8000" in members["journal.txt"] and support.REDACTED in members["journal.txt"]
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
    gathered = support.gather("1 day ago", commands=(), files=())
    gathered.files["big"] = b"x" * 1000

    def disk_full(self: object, *args: object, **kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(support.tarfile.TarFile, "addfile", disk_full)
    with pytest.raises(UserError, match=r"cannot be written \(No space left on device\)"):
        support.write(gathered, out)
    assert list(out.iterdir()) == []


def test_bad_options_are_one_line_and_exit_2(tools: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        support.run(argparse.Namespace(since="1 day ago", output=str(tmp_path / "missing")))
    with pytest.raises(UserError, match="--since needs a time"):
        support.run(argparse.Namespace(since="x\nExecStart=", output=str(tmp_path)))


def test_redaction_keeps_what_is_not_a_secret() -> None:
    text = "engine ready; version 1.0.0; digest sha256:" + "ab" * 32 + "; token bucket refilled; recovery key shown once"
    assert support.redact(text) == text
