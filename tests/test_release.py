# SPDX-License-Identifier: MIT
"""Release bundles (builder/release.py) and the helpers the update tests share.

A fake build output stands in for mkosi's: small partition images, a minimal PE file with the
.cmdline (usrhash=) and .osrel sections of a unified kernel image, and a manifest signed with a
throwaway key.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fake_release import bundle, demo_config, fake_build, make_signing, package_manifest, usrhash_for

from appliance.errors import Refused, UserError
from appliance.signed import bundle_index, release_manifest
from builder import build, release

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


# ----------------------------------------------------------------------------------- tests


def test_bundle_round_trip(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    assert index.version == "2.0.0" and index.profile == "demo"
    assert index.usrhash == usrhash_for("2.0.0")
    names = sorted(p.name for p in b.iterdir())
    assert names == sorted([f.name for f in index.files] + ["bundle.json", "bundle.json.sig", "timestamp.json", "timestamp.json.sig",
                                                            "appliance_2.0.0.packages.json"])
    for f in index.files:
        data = (b / f.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.size
    sums = dict(reversed(line.split("  ")) for line in (b / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {f.name for f in index.files} - {"SHA256SUMS"} | {"appliance_2.0.0.packages.json"}
    assert index.manifest_sha256 == hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()
    assert (b / "bundle.json").read_bytes() == release_manifest.canonical(json.loads((b / "bundle.json").read_text()))
    assert not list(tmp_path.glob(".bundle-*"))  # no temporary directory left behind


def test_bundle_replaces_atomically_and_keeps_old_on_failure(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    b = bundle(tmp_path, key)
    before = (b / "bundle.json").read_bytes()
    config = demo_config("2.0.0")
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(UserError):
        release.make_bundle(config, broken, b, key)
    assert (b / "bundle.json").read_bytes() == before


def test_versions_increase_strictly(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    first = bundle(tmp_path, key, "2.0.0")
    with pytest.raises(UserError, match=r"2\.0\.0 is the same as the previous release 2\.0\.0"):
        bundle(tmp_path, key, "2.0.0", previous_version="2.0.0")
    with pytest.raises(UserError, match=r"1\.9 is older than the previous release 2\.0\.0"):
        bundle(tmp_path, key, "1.9", previous_bundle_or_engine_digests=first)
    bundle(tmp_path, key, "2.0.1", previous_bundle_or_engine_digests=first)


@pytest.mark.parametrize("profile", ["demo", "production"])
def test_a_release_of_the_version_just_built_says_to_raise_the_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], profile: str
) -> None:
    # docs/upgrades.md's `release --previous VERSION` right after a build of that same version:
    # the refusal names the version and the key to raise, before any key or build output is looked at
    from appliance.config import load
    from builder.__main__ import main

    version = load(REPO / "appliance.toml", profile).appliance.version
    argv = ["--profile", profile, "--config", str(REPO / "appliance.toml"), "release", "--build-output", str(tmp_path / "none"),
            "--signing-key", str(tmp_path / "no.key"), "--output", str(tmp_path / "b"), "--previous", version]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: version {version} is the same as the previous release {version}: appliance.version was not raised",
                   f"hint: raise appliance.version in appliance.toml above {version}, then `python3 -m builder --profile {profile} build`"]
    assert not (tmp_path / "b").exists()


def test_engine_image_only_when_its_digest_is_new(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    first = bundle(tmp_path, key, "2.0.0", engine=True)
    idx1 = json.loads((first / "bundle.json").read_text())
    assert any(f["name"].startswith("engine_") for f in idx1["files"])
    # same engine as the previous bundle: no engine bytes
    second = bundle(tmp_path, key, "2.1.0", engine=True, previous_bundle_or_engine_digests=first)
    idx2 = bundle_index.verify_index((second / "bundle.json").read_bytes(), (second / "bundle.json.sig").read_bytes(), trusted)
    assert not any(f.name.startswith("engine_") for f in idx2.files)
    assert idx2.engine_digest == idx1["engine_digest"]
    # a new engine digest: shipped
    new_digest = "sha256:" + "ab" * 32
    third = bundle(tmp_path, key, "2.2.0", engine=True, digest=new_digest, previous_bundle_or_engine_digests=[idx1["engine_digest"]])
    assert (third / "engine_abababababab.raw").is_file()


def test_release_refuses_a_build_of_another_version(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    out = fake_build(tmp_path / "out", demo_config("2.0.0"), key)
    with pytest.raises(UserError, match="version"):
        release.make_bundle(demo_config("3.0.0"), out, tmp_path / "b", key)


def test_cli_parser_wires_release(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    release.add_parser(sub)
    args = parser.parse_args(["release", "--output", str(tmp_path / "b"), "--previous", "1.0.0"])
    assert args.func is release.cmd_release and args.previous == "1.0.0"


# ----------------------------------------------------------------------------------- the index's schema


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda i: i.update(extra=1), r"unknown field 'extra'"),
        (lambda i: i.pop("signer"), r"missing field 'signer'"),
        (lambda i: i["files"][0].update(size=True), r"files\[0\]\.size = True"),  # a bool is not a size
        (lambda i: i["files"][0].update(size=1.0), r"files\[0\]\.size = 1\.0"),
        (lambda i: i["files"][0].update(size=10**30), r"files\[0\]\.size"),
        (lambda i: i["files"][0].update(size=-1), r"files\[0\]\.size = -1"),
        (lambda i: i.update(format=2), r"format = 2"),
        (lambda i: i["partition_sizes"].update(x=1), r"partition_sizes"),
        (lambda i: i.update(files=[]), r"files"),
    ],
)
def test_index_schema_refusals_are_one_line(tmp_path: Path, signing: tuple[Path, Path], change: Any, match: str) -> None:
    key, _ = signing
    index = json.loads((bundle(tmp_path, key) / "bundle.json").read_text())
    assert bundle_index.load_index(index).version == "2.0.0"
    change(index)
    with pytest.raises(Refused, match=match) as e:
        bundle_index.validate_index(index)
    assert e.value.exit_status == 1 and "\n" not in e.value.message and e.value.hint


def test_manifest_loads_as_the_typed_model(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    data = release_manifest.parse_canonical((bundle(tmp_path, key) / "manifest.json").read_bytes())
    model = release_manifest.load(data)
    assert model.version == data["version"] and model.engine_image.digest == data["engine_image"]["digest"]
    assert [f.path for f in model.files] == [f["path"] for f in data["files"]]


def test_the_kernel_image_facts_are_read_back(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    b = bundle(tmp_path, key)
    facts = bundle_index.uki_facts(b / "appliance_2.0.0.efi")
    assert facts == {"usrhash": usrhash_for("2.0.0"), "image_version": "2.0.0"}


def test_release_reports_copying_and_hashing_the_payloads(
    tmp_path: Path, signing: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = signing
    b = bundle(tmp_path, key, usr_bytes=3 << 20)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["copying payloads", "hashing payloads"]
    assert all(" (100%), " in line and ", done in " in line for line in err)
    hashed = sum((b / n).stat().st_size for n in os.listdir(b) if n not in ("SHA256SUMS", "bundle.json", "bundle.json.sig"))
    assert err[1].startswith(f"hashing payloads: {hashed / (1 << 20):.1f} MiB/")


def test_the_release_command_summarises_the_bundle_and_reports_progress(
    tmp_path: Path, signing: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance.config import load
    from builder.__main__ import main

    key, trusted = signing
    config = load(REPO / "appliance.toml", "demo")  # what the command reads
    version = config.appliance.version
    out = fake_build(tmp_path / "out", config, key)
    b = tmp_path / "bundle"
    argv = ["release", "--profile", "demo", "--config", str(REPO / "appliance.toml"), "--build-output", str(out),
            "--signing-key", str(key), "--output", str(b), "--engine-digest", config.engine.digest]
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    total = sum(f.size for f in index.files)
    assert stdout == f"bundle {version} (demo) at {b}: {len(index.files)} files, {total} bytes, without an engine image\n"
    assert [line.split(":")[0] for line in stderr.splitlines()] == ["copying payloads", "hashing payloads"]


@pytest.mark.parametrize("previous", ["out/bundles/demo-1.0.0", "1.0.0-rc1", "1" * 5000])
def test_a_previous_that_is_neither_a_bundle_directory_nor_a_version_is_one_line(
    tmp_path: Path, signing: tuple[Path, Path], capsys: pytest.CaptureFixture[str], previous: str
) -> None:
    from builder.__main__ import main

    key, _ = signing
    config = demo_config("2.0.0")
    out = fake_build(tmp_path / "out", config, key)
    argv = ["--profile", "demo", "release", "--build-output", str(out), "--signing-key", str(key),
            "--output", str(tmp_path / "b"), "--previous", str(tmp_path / previous) if "/" in previous else previous]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: --previous '") and "no such bundle directory" in err[0]
    assert err[1].startswith("hint: ") and "--previous 1.0.0" in err[1]
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------------- the package manifest

PACKAGES = "appliance_2.0.0.packages.json"


def test_a_bundle_carries_the_package_manifest_bound_by_the_signed_index(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    assert json.loads((b / PACKAGES).read_text()) == package_manifest("2.0.0")  # mkosi's manifest as it was
    # the signed index lists SHA256SUMS (size, SHA-256), which lists the package manifest's SHA-256
    listed = {f.name: f for f in index.files}
    sums_data = (b / "SHA256SUMS").read_bytes()
    assert (hashlib.sha256(sums_data).hexdigest(), len(sums_data)) == (listed["SHA256SUMS"].sha256, listed["SHA256SUMS"].size)
    assert f"{hashlib.sha256((b / PACKAGES).read_bytes()).hexdigest()}  {PACKAGES}" in sums_data.decode().splitlines()
    packages = bundle_index.read_packages(b, index)
    assert (packages[0].name, packages[0].architecture) == ("systemd", "amd64") and len(packages) == 3


@pytest.mark.programs
def test_the_updater_never_sees_the_package_manifest(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    """Informational: not in the index's file list (an updater of today refuses a list that differs
    from payload_names, and fetches every file listed), so neither fetched nor staged."""
    from applianctl.update import download

    key, trusted = signing
    b = bundle(tmp_path, key, engine=True, with_install_image=True)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    names = {f.name for f in index.files}
    assert PACKAGES not in names and names == set(bundle_index.payload_names("2.0.0", index.engine_digest, True, True).values())
    assert PACKAGES not in {f.name for f in download.to_fetch(index, engine=True)}


def _tamper_manifest(b: Path) -> None:
    doc = json.loads((b / PACKAGES).read_text())
    doc["packages"][0]["version"] = "999"
    (b / PACKAGES).write_text(json.dumps(doc))


def _tamper_manifest_and_sums(b: Path) -> None:
    _tamper_manifest(b)
    digest = hashlib.sha256((b / PACKAGES).read_bytes()).hexdigest()
    lines = [f"{digest}  {PACKAGES}" if line.endswith(PACKAGES) else line for line in (b / "SHA256SUMS").read_text().splitlines()]
    (b / "SHA256SUMS").write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (_tamper_manifest, r"packages\.json: its SHA-256 is not the one SHA256SUMS"),
        (_tamper_manifest_and_sums, r"SHA256SUMS: not the one the signed bundle index names"),
        (lambda b: (b / PACKAGES).unlink(), r"packages\.json: no such file"),
    ],
)
def test_a_tampered_package_manifest_fails_verification(tmp_path: Path, signing: tuple[Path, Path], tamper: Any, match: str) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    tamper(b)
    with pytest.raises(Refused, match=match) as e:
        bundle_index.read_packages(b, index)
    assert "\n" not in e.value.message and e.value.hint


def _bad_shape(doc: dict[str, Any]) -> dict[str, Any]:
    del doc["packages"][1]["architecture"]
    return doc


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, r"missing from the build output \(no package manifest\)"),
        (b"{not json", r"not JSON"),
        (b"[]", r"not mkosi's package manifest"),
        (json.dumps({**package_manifest("2.0.0"), "manifest_version": 2}).encode(), r"manifest_version 1 expected"),
        (json.dumps({**package_manifest("2.0.0"), "packages": []}).encode(), r"packages is not a list of packages"),
        (json.dumps(_bad_shape(package_manifest("2.0.0"))).encode(), r"packages\[1\] = .*: expected name, version and architecture"),
    ],
)
def test_release_refuses_a_build_without_a_valid_package_manifest(
    tmp_path: Path, signing: tuple[Path, Path], content: bytes | None, match: str
) -> None:
    key, _ = signing
    config = demo_config("2.0.0")
    out = fake_build(tmp_path / "out", config, key)
    path = out / "appliance_2.0.0.manifest"
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match=match) as e:
        release.make_bundle(config, out, tmp_path / "b", key, [config.engine.digest])
    assert "\n" not in e.value.message and "ManifestFormat=json" in e.value.hint
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


@pytest.mark.parametrize("written", [None, "{", "1.9.0", "ok"])
def test_build_refuses_mkosi_output_without_a_package_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str | None
) -> None:
    """build.build with mkosi stood in for: the package manifest lands in the output with the disk
    image, and an output without one (or with a broken one) is refused, nothing replaced."""
    config = demo_config("2.0.0")
    final = tmp_path / "out" / "demo"
    final.mkdir(parents=True)
    (final / "previous").write_text("the last good build")

    def fake_mkosi(command: list[str], **kw: Any) -> None:
        staging = final.with_name("demo.tmp")
        (staging / "appliance_2.0.0.raw").write_bytes(b"disk")
        (staging / "tools").mkdir()
        if written is not None:
            text = {"ok": json.dumps(package_manifest("2.0.0")), "1.9.0": json.dumps(package_manifest("1.9.0"))}.get(written, written)
            (staging / "appliance_2.0.0.manifest").write_text(text)

    for name, value in (("signing_key_for", lambda config, key: tmp_path / "release.key"),
                        ("prepare", lambda *a: (tmp_path, tmp_path, tmp_path)), ("mkosi_command", lambda: ["mkosi"]),
                        ("mkosi_arguments", lambda *a: []), ("checked", fake_mkosi)):
        monkeypatch.setattr(build, name, value)
    if written == "ok":
        result = build.build(config, output=final)
        assert json.loads((result.output_dir / "appliance_2.0.0.manifest").read_text()) == package_manifest("2.0.0")
        assert not (final / "previous").exists()
        return
    match = {None: "mkosi wrote no package manifest at", "{": r"appliance_2\.0\.0\.manifest: not JSON",
             "1.9.0": r"config\.version = '1\.9\.0': the manifest of another build than 2\.0\.0"}[written]
    with pytest.raises(UserError, match=match) as e:
        build.build(config, output=final)
    assert "ManifestFormat=json" in e.value.hint and "\n" not in e.value.message
    assert [p.name for p in final.iterdir()] == ["previous"] and not final.with_name("demo.tmp").exists()


def test_image_config_asks_mkosi_for_the_package_manifest() -> None:
    text = (REPO / "image/mkosi.conf").read_text()
    output = text.split("[Output]", 1)[1].split("\n[", 1)[0]
    assert "\nManifestFormat=json\n" in output
