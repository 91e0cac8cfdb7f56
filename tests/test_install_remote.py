# SPDX-License-Identifier: MIT
"""Installing from a release bundle over HTTPS (installer/remote.py): `builder release
--install-image` adds the disk image and its block map, the updater never fetches them, and the
installer downloads only what an install needs, each file proven by the signed index, from the
URL the verified plan gives when there is no medium."""

from __future__ import annotations

import json
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_release import bundle, demo_config, make_signing
from test_fetch import Server, body, make_ca, make_server_cert

import installer.__main__
from appliance.errors import Refused, UserError
from appliance.signed import bundle_index
from applianctl.update import download
from builder import sign_plan
from installer import install, remote

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)


@pytest.fixture(autouse=True)
def no_wait_online(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the build host's networkd is not the installer's: never wait for it here
    monkeypatch.setattr(remote, "WAIT_ONLINE", str(tmp_path / "no-such-wait-online"))


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


@pytest.fixture
def https(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    key, ca, ca_path = make_ca(tmp_path, "release-ca")
    crt, pem = make_server_cert(tmp_path, key, ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, pem)
    server = Server(ctx)
    yield server, ca_path
    server.close()


def serve(server: Server, directory: Path, prefix: str = "/v1/") -> str:
    for f in directory.iterdir():
        server.routes[prefix + f.name] = body(f.read_bytes())
    return server.url.rstrip("/") + prefix


def test_release_adds_the_install_image_which_the_updater_never_fetches(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, with_install_image=True)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    names = bundle_index.install_names("2.0.0")
    assert set(names.values()) <= {f.name for f in index.files}
    assert not set(names.values()) & {f.name for f in download.to_fetch(index)}
    unpacked = subprocess.run(["zstd", "-d", "-c", str(b / names["install-image"])], capture_output=True, check=True).stdout
    assert unpacked == (tmp_path / "out-2.0.0" / "appliance_2.0.0.raw").read_bytes()
    assert install.image_size(b / names["install-bmap"]) == 8 << 20


def test_an_index_with_half_the_install_image_is_refused(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    b = bundle(tmp_path, key, with_install_image=True)
    doc = json.loads((b / "bundle.json").read_text())
    doc["files"] = [f for f in doc["files"] if not f["name"].endswith(".raw.bmap")]
    with pytest.raises(Refused, match="not that of a release bundle"):
        bundle_index.load_index(doc)


def test_the_installer_downloads_only_what_an_install_needs(tmp_path: Path, signing: tuple[Path, Path],
                                                             https: tuple[Server, Path]) -> None:
    key, trusted = signing
    server, ca = https
    url = serve(server, bundle(tmp_path, key, with_install_image=True))
    got = remote.download(url, str(ca), trusted, tmp_path / "release")
    payload = install.load_payload(got, trusted)
    assert payload.image.name == "appliance_2.0.0.raw.zst" and payload.version == "2.0.0"
    assert install.required_bytes(payload) == (8 << 20) + install.LAYOUT_EXTRA
    fetched = {p.rsplit("/", 1)[1] for p in server.requests}
    assert not any(n.endswith(".usr.raw") or n.startswith("engine_") or n.endswith(".efi") for n in fetched), fetched


def test_a_changed_install_image_is_refused_and_not_kept(tmp_path: Path, signing: tuple[Path, Path],
                                                          https: tuple[Server, Path]) -> None:
    key, trusted = signing
    server, ca = https
    b = bundle(tmp_path, key, with_install_image=True)
    url = serve(server, b)
    image = bundle_index.install_names("2.0.0")["install-image"]
    data = bytearray((b / image).read_bytes())
    data[-1] ^= 1
    server.routes[f"/v1/{image}"] = body(bytes(data))
    with pytest.raises(Refused, match=r"does not match bundle\.json"):
        remote.download(url, str(ca), trusted, tmp_path / "release")
    assert not (tmp_path / "release" / image).exists() and not (tmp_path / "release" / f"{image}.part").exists()


def test_an_untrusted_bundle_is_refused_before_any_payload(tmp_path: Path, signing: tuple[Path, Path],
                                                           https: tuple[Server, Path]) -> None:
    _, trusted = signing
    stranger, _ = make_signing(tmp_path / "stranger")
    server, ca = https
    url = serve(server, bundle(tmp_path, stranger, with_install_image=True))
    with pytest.raises(Refused, match="does not trust"):
        remote.download(url, str(ca), trusted, tmp_path / "release")
    assert server.requests == ["/v1/bundle.json", "/v1/bundle.json.sig"]


def test_a_bundle_without_the_install_image_says_how_to_make_one(tmp_path: Path, signing: tuple[Path, Path],
                                                                 https: tuple[Server, Path]) -> None:
    key, trusted = signing
    server, ca = https
    url = serve(server, bundle(tmp_path, key))
    with pytest.raises(UserError, match="carries no install image") as e:
        remote.download(url, str(ca), trusted, tmp_path / "release")
    assert "--install-image" in e.value.hint


def test_without_a_medium_the_verified_plans_update_url_is_used(tmp_path: Path, signing: tuple[Path, Path],
                                                                https: tuple[Server, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    server, ca = https
    url = serve(server, bundle(tmp_path, key, with_install_image=True))
    toml = tmp_path / "plan.toml"
    toml.write_text(f'hostname = "gpu-09"\n[update]\nurl = "{url}"\n[target]\nserial = "S1"\n')
    sign_plan.write(toml, key, tmp_path / "plan", demo_config("1.0.0"))
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "appliance.install-plan").write_bytes((tmp_path / "plan" / "plan.json").read_bytes())
    (creds / "appliance.install-plan.sig").write_bytes((tmp_path / "plan" / "plan.json.sig").read_bytes())
    (creds / remote.CA_CREDENTIAL).write_bytes(ca.read_bytes())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    monkeypatch.setattr(installer.__main__, "find_medium", lambda: None)
    monkeypatch.setattr(installer.__main__.paths, "TRUSTED_KEYS_DIR", trusted)
    monkeypatch.setattr(remote, "RELEASE_DIR", tmp_path / "release")
    seen: dict[str, object] = {}

    def fake_install(payload: install.Payload, plan: object, plan_dir: Path, **kw: object) -> int:
        seen["payload"], seen["plan"] = payload, plan
        return 0

    monkeypatch.setattr(installer.__main__.install, "install", fake_install)
    # the server's CA is a private one: the download succeeds only with the credential's CA
    assert installer.__main__.main(["--no-reboot"]) == 0
    payload = seen["payload"]
    assert isinstance(payload, install.Payload) and payload.version == "2.0.0"
    assert payload.image == tmp_path / "release" / "appliance_2.0.0.raw.zst"
    assert any(r.endswith(".raw.zst") for r in server.requests)


def test_without_a_medium_or_a_url_nothing_is_written(tmp_path: Path, signing: tuple[Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    key, trusted = signing
    toml = tmp_path / "plan.toml"
    toml.write_text('[target]\nserial = "S1"\n')
    sign_plan.write(toml, key, tmp_path / "plan", demo_config("1.0.0"))
    monkeypatch.setattr(installer.__main__, "find_medium", lambda: None)
    monkeypatch.setattr(installer.__main__.paths, "TRUSTED_KEYS_DIR", trusted)
    assert installer.__main__.main(["--plan", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert "no release URL" in err and "hint:" in err and "Traceback" not in err
