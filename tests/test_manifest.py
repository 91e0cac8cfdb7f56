# SPDX-License-Identifier: MIT
"""The signed release manifest (appliance/signed/release_manifest.py), signing keys (builder/keys.py) and
`applianctl verify` (applianctl/slots/release_verify.py)."""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance import paths
from appliance.errors import UserError
from appliance.signed import release_manifest
from applianctl.slots import release_verify
from builder import keys

OVERLAY = b"print('overlay')\n"
TABLE = b"gfx,cu_num,M,N,K,libtype,kernelId,splitK,us,kernelName,tflops,bw,errRatio\n"
FIRMWARE = b"\x00\x01firmware"


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return keys.generate(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def other_keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return keys.generate(tmp_path_factory.mktemp("otherkeys"))


@pytest.fixture(scope="module")
def trusted(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> Path:
    directory = tmp_path_factory.mktemp("trusted")
    pub = keypair[1]
    (directory / keys.trusted_name(pub)).write_bytes(pub.read_bytes())
    return directory


def make_manifest(signer: str) -> dict[str, Any]:
    return {
        "version": "1.2.0",
        "min_version": "1.0.0",
        "build_time": "2026-08-04T12:00:00Z",
        "profile": "demo",
        "engine_image": {
            "reference": "localhost/appliance-standin-engine@sha256:" + "0" * 64,
            "digest": "sha256:" + "0" * 64,
            "store_label": "engine_000000000000",
            "store_roothash": "1" * 64,
        },
        "model": {"id": "standin/tiny-demo", "revision": "0" * 39 + "1"},
        "kernel_version": "6.12.38+deb13-amd64",
        "files": [
            {
                "kind": "overlay",
                "path": "overlays/demo/standin_answers.py",
                "target": "/opt/standin/standin/answers.py",
                "sha256": sha(OVERLAY),
            },
            {
                "kind": "diff",
                "path": "overlays/diffs/standin_answers.patch",
                "target": "/opt/standin/standin/answers.py",
                "sha256": "1" * 64,
            },
            {
                "kind": "tuning",
                "path": "tuning/demo/demo.csv",
                "target": "/opt/aiter-configs/demo.csv",
                "sha256": sha(TABLE),
            },
            {
                "kind": "firmware",
                "path": "firmware/amdgpu/psp_13_0_6_sos.bin",
                "target": "/usr/lib/firmware/updates/amdgpu/psp_13_0_6_sos.bin",
                "sha256": sha(FIRMWARE),
            },
        ],
        "signer": signer,
    }


@pytest.fixture(scope="module")
def signed(keypair: tuple[Path, Path]) -> tuple[dict[str, Any], bytes, bytes]:
    m = make_manifest(keys.public_key_id(keypair[1]))
    return m, release_manifest.dumps(m), release_manifest.sign(m, keypair[0])


# ----------------------------------------------------------------------------- canonical form

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60)
@given(json_values)
def test_canonical_round_trip(value: Any) -> None:
    data = release_manifest.canonical(value)
    assert json.loads(data.decode("utf-8")) == value
    assert release_manifest.parse_canonical(data) == value
    assert release_manifest.canonical(release_manifest.parse_canonical(data)) == data


@settings(max_examples=60)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.randoms())
def test_canonical_ignores_key_order(value: dict[str, Any], rnd: Any) -> None:
    items = list(value.items())
    rnd.shuffle(items)
    assert release_manifest.canonical(dict(items)) == release_manifest.canonical(value)


def test_canonical_form_is_compact_sorted_utf8() -> None:
    assert release_manifest.canonical({"b": 1, "a": ["é", None, True]}) == '{"a":["é",null,true],"b":1}'.encode()


@pytest.mark.parametrize("value", [1.5, {"a": 0.0}, [float("nan")], {1: "x"}, {"a": b"bytes"}])
def test_canonical_refuses_non_json(value: Any) -> None:
    with pytest.raises(release_manifest.ManifestError):
        release_manifest.canonical(value)


@pytest.mark.parametrize(
    "data",
    [b'{"a": 1}', b'{"b":1,"a":2}', b'{"a":1,"a":1}', b'{"a":1.0}', b'{"a":NaN}', b'{"a":"\\u00e9"}', b"\xff", b"{"],
)
def test_parse_refuses_non_canonical(data: bytes) -> None:
    with pytest.raises(release_manifest.ManifestError):
        release_manifest.parse_canonical(data)


# ----------------------------------------------------------------------------- schema


def test_valid_manifest_passes(keypair: tuple[Path, Path]) -> None:
    m = make_manifest(keys.public_key_id(keypair[1]))
    assert release_manifest.loads(release_manifest.dumps(m)) == m


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(extra="x"),
        lambda m: m["engine_image"].update(tag="latest"),
        lambda m: m["files"][0].update(mode="0644"),
        lambda m: m.pop("min_version"),
        lambda m: m.update(version="1.2.0-rc1"),
        lambda m: m.update(min_version="2.0"),
        lambda m: m.update(profile="staging"),
        lambda m: m.update(signer="ABCDEF0123456789"),
        lambda m: m["files"][0].update(kind="script"),
        lambda m: m["files"][0].update(path="../etc/passwd"),
        lambda m: m["files"][0].update(path="/etc/passwd"),
        lambda m: m["files"][0].update(target="opt/relative.py"),
        lambda m: m["files"][0].update(target="/opt/../etc/shadow"),
        lambda m: m["files"][0].update(sha256="0" * 63),
        lambda m: m["files"].append(dict(m["files"][0])),
        lambda m: m["files"][3].update(target="/lib/firmware/x.bin"),
        lambda m: m.update(build_time=1754308800),
    ],
)
def test_schema_refusals(keypair: tuple[Path, Path], change: Any) -> None:
    m = make_manifest(keys.public_key_id(keypair[1]))
    change(m)
    with pytest.raises(release_manifest.ManifestError):
        release_manifest.dumps(m)


def test_unknown_field_is_named(keypair: tuple[Path, Path]) -> None:
    m = make_manifest(keys.public_key_id(keypair[1]))
    m["model"]["quantization"] = "fp8"
    with pytest.raises(release_manifest.ManifestError, match=r"unknown field 'model\.quantization'"):
        release_manifest.dumps(m)


# ----------------------------------------------------------------------------- keys


def test_generate_writes_private_key_0600(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        private, public = keys.generate(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    import hashlib

    assert keys.public_key_id(public) == hashlib.sha256(raw).hexdigest()[:16]
    assert not [p for p in (tmp_path / "k").iterdir() if p.name.endswith(".tmp")]


def test_generate_refuses_to_overwrite(tmp_path: Path) -> None:
    private, public = keys.generate(tmp_path)
    before = private.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        keys.generate(tmp_path)
    assert private.read_bytes() == before
    public.unlink()
    with pytest.raises(UserError, match="already exists"):
        keys.generate(tmp_path)


def test_default_key_directory_is_gitignored() -> None:
    assert Path(__file__).resolve().parents[1] / "keys" == keys.DEFAULT_DIR
    ignore = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "/keys/" in ignore and "*.key" in ignore


def test_sign_refuses_group_readable_key(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    copy_ = tmp_path / "loose.key"
    copy_.write_bytes(keypair[0].read_bytes())
    copy_.chmod(0o640)
    with pytest.raises(release_manifest.ManifestError, match="readable by others"):
        release_manifest.sign(make_manifest(keys.public_key_id(keypair[1])), copy_)


def test_sign_refuses_wrong_signer(keypair: tuple[Path, Path]) -> None:
    with pytest.raises(release_manifest.ManifestError, match="names signer"):
        release_manifest.sign(make_manifest("0123456789abcdef"), keypair[0])


# ----------------------------------------------------------------------------- sign / verify


def test_sign_verify_round_trip(signed: tuple[dict[str, Any], bytes, bytes], trusted: Path) -> None:
    m, data, sig = signed
    assert sig.endswith(b"\n") and len(base64.b64decode(sig)) == 64
    assert release_manifest.verify(data, sig, trusted) == release_manifest.load(m)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_change_is_detected(
    signed: tuple[dict[str, Any], bytes, bytes], trusted: Path, data: st.DataObject
) -> None:
    _, body, sig = signed
    in_sig = data.draw(st.booleans())
    target = sig if in_sig else body
    index = data.draw(st.integers(min_value=0, max_value=len(target) - 1))
    new = data.draw(st.integers(min_value=0, max_value=255).filter(lambda b: b != target[index]))
    changed = target[:index] + bytes([new]) + target[index + 1 :]
    with pytest.raises(release_manifest.ManifestError):
        if in_sig:
            release_manifest.verify(body, changed, trusted)
        else:
            release_manifest.verify(changed, sig, trusted)


def test_untrusted_key_is_refused(trusted: Path, other_keypair: tuple[Path, Path]) -> None:
    m = make_manifest(keys.public_key_id(other_keypair[1]))
    sig = release_manifest.sign(m, other_keypair[0])
    with pytest.raises(release_manifest.ManifestError, match="not trusted"):
        release_manifest.verify(release_manifest.dumps(m), sig, trusted)


def test_rotation_trusts_both_keys(
    tmp_path: Path, keypair: tuple[Path, Path], other_keypair: tuple[Path, Path]
) -> None:
    for _, pub in (keypair, other_keypair):
        (tmp_path / keys.trusted_name(pub)).write_bytes(pub.read_bytes())
    for private, pub in (keypair, other_keypair):
        m = make_manifest(keys.public_key_id(pub))
        assert release_manifest.verify(release_manifest.dumps(m), release_manifest.sign(m, private), tmp_path).signer == keys.public_key_id(
            pub
        )


@pytest.mark.parametrize(
    "mangle",
    [
        lambda s: s[:40],  # truncated
        lambda s: s[:-5] + b"\n",  # truncated at the end
        lambda s: b"",
        lambda s: b"not base64 at all!\n",
        lambda s: s.rstrip(b"\n") + b"\n\n",
        lambda s: b" " + s,
        lambda s: s.rstrip(b"\n") + b"\r\n",
        lambda s: base64.b64encode(base64.b64decode(s) + b"\0") + b"\n",  # 65 bytes
    ],
)
def test_malformed_signature_is_refused(
    signed: tuple[dict[str, Any], bytes, bytes], trusted: Path, mangle: Any
) -> None:
    _, data, sig = signed
    with pytest.raises(release_manifest.ManifestError, match="signature"):
        release_manifest.verify(data, mangle(sig), trusted)


def test_unknown_field_refused_even_when_signed(keypair: tuple[Path, Path], trusted: Path) -> None:
    m = make_manifest(keys.public_key_id(keypair[1]))
    m["surprise"] = "x"
    data = release_manifest.canonical(m)
    key = release_manifest.load_private_key(keypair[0])
    sig = release_manifest.encode_signature(key.sign(data))
    with pytest.raises(release_manifest.ManifestError, match="unknown field 'surprise'"):
        release_manifest.verify(data, sig, trusted)


def test_no_trusted_keys(signed: tuple[dict[str, Any], bytes, bytes], tmp_path: Path) -> None:
    _, data, sig = signed
    with pytest.raises(release_manifest.ManifestError, match="no trusted keys"):
        release_manifest.verify(data, sig, tmp_path)


# ----------------------------------------------------------------------------- applianctl verify


@pytest.fixture
def device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: tuple[dict[str, Any], bytes, bytes], trusted: Path
) -> Path:
    _, data, sig = signed
    lib = tmp_path / "usr/lib/appliance"
    (lib / "keys").mkdir(parents=True)
    for pub in trusted.iterdir():
        (lib / "keys" / pub.name).write_bytes(pub.read_bytes())
    (lib / "manifest.json").write_bytes(data)
    (lib / "manifest.json.sig").write_bytes(sig)
    (lib / "engine/overlays").mkdir(parents=True)
    (lib / "engine/tuning").mkdir(parents=True)
    (lib / "engine/overlays/standin_answers.py").write_bytes(OVERLAY)
    (lib / "engine/tuning/demo.csv").write_bytes(TABLE)
    fw = tmp_path / "usr/lib/firmware/updates/amdgpu"
    fw.mkdir(parents=True)
    (fw / "psp_13_0_6_sos.bin").write_bytes(FIRMWARE)
    monkeypatch.setattr(paths, "MANIFEST", lib / "manifest.json")
    monkeypatch.setattr(paths, "MANIFEST_SIG", lib / "manifest.json.sig")
    monkeypatch.setattr(paths, "TRUSTED_KEYS_DIR", lib / "keys")
    monkeypatch.setattr(paths, "ENGINE_FILES_DIR", lib / "engine")
    monkeypatch.setattr(paths, "VERIFY_RESULT", tmp_path / "run/appliance/verify.json")
    monkeypatch.setenv("APPLIANCE_FIRMWARE_DIR", str(fw))
    return tmp_path


def run_verify(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    code = release_verify.run(argparse.Namespace(command="verify", debug=False))
    result = json.loads(paths.VERIFY_RESULT.read_text())
    return code, result, capsys.readouterr().err


def test_verify_ok(device: Path, capsys: pytest.CaptureFixture[str], keypair: tuple[Path, Path]) -> None:
    code, result, err = run_verify(capsys)
    assert code == 0, err
    assert result["ok"] is True
    assert result["version"] == "1.2.0"
    assert result["signer"] == keys.public_key_id(keypair[1])
    assert err == ""
    assert not [p for p in paths.VERIFY_RESULT.parent.iterdir() if p.name != "verify.json"]


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda d: flip(d / "usr/lib/appliance/engine/overlays/standin_answers.py"), "standin_answers.py"),
        (lambda d: flip(d / "usr/lib/appliance/engine/tuning/demo.csv"), "demo.csv"),
        (lambda d: flip(d / "usr/lib/firmware/updates/amdgpu/psp_13_0_6_sos.bin"), "psp_13_0_6_sos.bin"),
        (lambda d: (d / "usr/lib/appliance/engine/tuning/demo.csv").unlink(), "demo.csv: missing"),
        (lambda d: (d / "usr/lib/appliance/engine/overlays/extra.py").write_text("x"), "extra.py: not in the manifest"),
        (lambda d: flip(d / "usr/lib/appliance/manifest.json"), "manifest"),
        (lambda d: flip(d / "usr/lib/appliance/manifest.json.sig"), "signature"),
        (lambda d: (d / "usr/lib/appliance/manifest.json.sig").unlink(), "manifest.json.sig: missing"),
        (lambda d: symlink_over(d / "usr/lib/appliance/engine/tuning/demo.csv"), "symlink"),
    ],
)
def test_verify_fails_naming_the_file(
    device: Path, capsys: pytest.CaptureFixture[str], mutate: Any, named: str
) -> None:
    mutate(device)
    code, result, err = run_verify(capsys)
    assert code == 1
    assert result["ok"] is False
    assert named in result["reason"]
    assert "\n" not in result["reason"]
    assert err.count("\n") == 1 and named in err


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def symlink_over(path: Path) -> None:
    real = path.with_name("real.bin")
    path.rename(real)
    path.symlink_to(real)


def test_verify_parser() -> None:
    parser = argparse.ArgumentParser()
    release_verify.add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["verify"]).func is release_verify.run
    from applianctl.__main__ import COMMAND_MODULES

    assert COMMAND_MODULES["verify"] == "applianctl.slots.release_verify"


def test_manifest_copy_is_not_mutated_by_dumps(keypair: tuple[Path, Path]) -> None:
    m = make_manifest(keys.public_key_id(keypair[1]))
    before = copy.deepcopy(m)
    release_manifest.dumps(m)
    assert m == before


@pytest.mark.parametrize("version", ["1" * 5000, "1" * 10, "1.2.3.4.5", "", "1.x", "1..2", " 1"])
def test_version_tuple_refuses_what_is_not_a_version_before_int(version: str) -> None:
    # 5,000 digits is past Python's int-string limit: one refusal, never a ValueError traceback
    with pytest.raises(release_manifest.ManifestError, match="expected up to four numbers of up to 9 digits") as e:
        release_manifest.version_tuple(version)
    assert "\n" not in e.value.message and len(e.value.message) < 200 and e.value.hint


def test_version_tuple_of_versions() -> None:
    assert release_manifest.version_tuple("1.2") == (1, 2, 0, 0)
    assert release_manifest.version_tuple("999999999.0.0.1") == (999999999, 0, 0, 1)
