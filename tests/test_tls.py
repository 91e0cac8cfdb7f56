# SPDX-License-Identifier: MIT
"""applianctl tls: the appliance CA and the proxy's server certificate."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

import applianctl.__main__
from appliance import paths
from appliance.config import load
from appliance.errors import UserError
from applianctl import tls

HOST = "appliance.local"
ROOT = Path(__file__).resolve().parents[1]


def _appliance_json(tls_mode: str, hostname: str) -> str:
    """The production appliance.json with this proxy TLS mode and host name."""
    data = load(ROOT / "appliance.toml", "production").to_json()
    data["proxy"].update(tls=tls_mode, hostname=hostname, acme_email="ops@example.net")
    return json.dumps(data)
ADDRS: list[tls.IpAddress] = [
    ipaddress.IPv4Address("127.0.0.1"),
    ipaddress.IPv6Address("::1"),
    ipaddress.IPv4Address("10.0.2.15"),
]
NOW = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
NO_GROUP = "appliance-no-such-group"


def main(argv: list[str]) -> int:
    """`applianctl ARGV` with only this module registered (the others are tested elsewhere)."""
    parser = argparse.ArgumentParser(prog="applianctl")
    tls.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UserError as e:
        print(f"applianctl: {e.message}", file=sys.stderr)
        print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_status


def test_registered_with_applianctl() -> None:
    assert applianctl.__main__.COMMAND_MODULES["tls"] == "applianctl.tls"


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_run_creates_ca_and_server_certificate(tmp_path: Path) -> None:
    result = tls.generate(tmp_path / "tls", HOST, ADDRS, now=NOW, group=NO_GROUP)
    assert result.created_ca and result.renewed
    files = tls.Files(tmp_path / "tls")
    ca, server = _cert(files.ca_crt), _cert(files.server_crt)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert tls.not_after(ca) - NOW == datetime.timedelta(days=tls.CA_DAYS)
    assert tls.not_after(server) - NOW == datetime.timedelta(days=tls.SERVER_DAYS)
    dns, ips = tls.san_names(server)
    assert dns == [HOST]
    assert sorted(map(str, ips)) == sorted(map(str, ADDRS))
    assert server.issuer == ca.subject
    # Modes: private keys never world-readable; the CA key root-only.
    assert _mode(files.ca_key) == 0o600
    assert _mode(files.server_key) == 0o600  # no proxy group here: owner only
    assert _mode(files.ca_crt) == 0o644 and _mode(files.server_crt) == 0o644
    assert not [p.name for p in files.dir.iterdir() if p.name.startswith(".")], "temporary files left behind"


@pytest.mark.programs
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_chain_verifies_with_openssl(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=datetime.datetime.now(datetime.UTC), group=NO_GROUP)
    out = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(tmp_path / "ca.crt"),
            "-purpose",
            "sslserver",
            str(tmp_path / "server.crt"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and ": OK" in out.stdout, out.stdout + out.stderr


def test_server_key_is_group_readable_for_the_proxy_group(tmp_path: Path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name  # a group that exists and that we may chown to
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=group)
    key = tmp_path / "server.key"
    assert _mode(key) == 0o640
    assert key.stat().st_gid == os.getgid()
    assert _mode(tmp_path / "ca.key") == 0o600


def test_second_run_changes_nothing(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = tls.generate(tmp_path, HOST, list(reversed(ADDRS)), now=NOW + datetime.timedelta(days=59), group=NO_GROUP)
    assert not result.created_ca and not result.renewed
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_renews_when_fewer_than_30_days_remain(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    ca_before = (tmp_path / "ca.crt").read_bytes()
    old = _cert(tmp_path / "server.crt")
    later = NOW + datetime.timedelta(days=tls.SERVER_DAYS - tls.RENEW_DAYS + 1)
    result = tls.generate(tmp_path, HOST, ADDRS, now=later, group=NO_GROUP)
    assert result.renewed and not result.created_ca and "expires" in result.reason
    new = _cert(tmp_path / "server.crt")
    assert new.serial_number != old.serial_number
    assert tls.not_after(new) - later == datetime.timedelta(days=tls.SERVER_DAYS)
    assert (tmp_path / "ca.crt").read_bytes() == ca_before, "renewal must keep the CA clients trust"


NETS: list[tls.IpNetwork] = [ipaddress.IPv4Network("10.0.2.0/24"), ipaddress.IPv4Network("192.0.2.0/24")]


@pytest.mark.parametrize(
    "addresses",
    [[*ADDRS, ipaddress.IPv4Address("192.0.2.9")], ADDRS[:2]],
)
def test_renews_when_addresses_change(tmp_path: Path, addresses: list[tls.IpAddress]) -> None:
    tls.generate(tmp_path, HOST, ADDRS, networks=NETS, now=NOW, group=NO_GROUP)
    ca_before = (tmp_path / "ca.crt").read_bytes()
    result = tls.generate(tmp_path, HOST, addresses, now=NOW + datetime.timedelta(days=1), group=NO_GROUP)
    assert result.renewed and "names changed" in result.reason and not result.created_ca
    assert (tmp_path / "ca.crt").read_bytes() == ca_before
    dns, ips = tls.san_names(_cert(tmp_path / "server.crt"))
    assert dns == [HOST] and sorted(map(str, ips)) == sorted(map(str, addresses))


def test_a_new_hostname_gets_a_new_ca(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    result = tls.generate(tmp_path, "other.local", ADDRS, now=NOW + datetime.timedelta(days=1), group=NO_GROUP)
    assert result.created_ca and result.renewed
    assert tls.ca_constraints(_cert(tmp_path / "ca.crt")) is not None
    assert tls.ca_constraints(_cert(tmp_path / "ca.crt"))[0] == ["other.local"]  # type: ignore[index]
    assert tls.san_names(_cert(tmp_path / "server.crt"))[0] == ["other.local"]


@pytest.mark.programs
def test_an_address_outside_the_cas_networks_is_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CA clients trust is never replaced because DHCP handed out another address."""
    tls.generate(tmp_path, HOST, ADDRS, networks=NETS, now=NOW, group=NO_GROUP)
    ca_before = (tmp_path / "ca.crt").read_bytes()
    moved = [*ADDRS[:2], ipaddress.IPv4Address("198.51.100.7")]
    result = tls.generate(tmp_path, HOST, moved, now=NOW + datetime.timedelta(days=1), group=NO_GROUP)
    assert (tmp_path / "ca.crt").read_bytes() == ca_before and result.renewed
    assert sorted(map(str, tls.san_names(_cert(tmp_path / "server.crt"))[1])) == ["127.0.0.1", "::1"]
    assert "198.51.100.7 outside the appliance CA's networks" in capsys.readouterr().err
    _openssl_verify(tmp_path, tmp_path / "server.crt", expect_ok=True)


# ------------------------------------------------------------------------------ name constraints


def test_ca_is_name_constrained_critically(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, networks=NETS, now=NOW, group=NO_GROUP)
    ext = _cert(tmp_path / "ca.crt").extensions.get_extension_for_class(x509.NameConstraints)
    assert ext.critical and not ext.value.excluded_subtrees
    assert tls.ca_constraints(_cert(tmp_path / "ca.crt")) == (
        [HOST],
        [ipaddress.ip_network("10.0.2.0/24"), ipaddress.ip_network("127.0.0.0/8"),
         ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("::1/128")],
    )


def test_an_unconstrained_ca_from_an_older_version_is_replaced(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old CA")])
    old = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(NOW - datetime.timedelta(days=1))
        .not_valid_after(NOW + datetime.timedelta(days=100))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "ca.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "ca.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    result = tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    assert result.created_ca
    assert tls.ca_constraints(_cert(tmp_path / "ca.crt")) is not None


def _leaf(tmp_path: Path, dns: list[str], ips: list[tls.IpAddress], name: str) -> Path:
    """A leaf for DNS and IPS signed by the appliance CA in TMP_PATH (as a thief of ca.key would)."""
    from cryptography.hazmat.primitives import serialization

    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, tls.ec.EllipticCurvePrivateKey)
    ca = _cert(tmp_path / "ca.crt")
    _, leaf = tls.make_server(ca_key, ca, dns[0], [], NOW)
    if len(dns) > 1 or ips:
        # make_server puts only one DNS name; rebuild the SAN with every name asked for.
        from cryptography.hazmat.primitives import hashes

        builder = (
            x509.CertificateBuilder().subject_name(leaf.subject).issuer_name(ca.subject)
            .public_key(leaf.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(tls.not_before(leaf)).not_valid_after(tls.not_after(leaf))
            .add_extension(
                x509.SubjectAlternativeName([*map(x509.DNSName, dns), *map(x509.IPAddress, ips)]), critical=False
            )
        )
        leaf = builder.sign(ca_key, hashes.SHA256())
    path = tmp_path / name
    path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    return path


def _openssl_verify(tmp_path: Path, leaf: Path, *, expect_ok: bool) -> str:
    at = int((NOW + datetime.timedelta(days=2)).timestamp())
    out = subprocess.run(
        ["openssl", "verify", "-attime", str(at), "-CAfile", str(tmp_path / "ca.crt"), str(leaf)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (out.returncode == 0) == expect_ok, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.programs
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
@pytest.mark.parametrize(
    ("dns", "ips"),
    [
        (["www.example.com"], []),
        (["bank.example"], []),
        (["appliance.local.evil.example"], []),
        (["evilappliance.local"], []),
        (["appliance.locals"], []),
        ([HOST, "www.example.com"], []),
        ([HOST], [ipaddress.IPv4Address("8.8.8.8")]),
        ([HOST], [ipaddress.IPv4Address("10.0.3.1")]),
        ([HOST], [ipaddress.IPv6Address("2001:db8::1")]),
    ],
)
def test_a_leaf_for_another_name_fails_verification(
    tmp_path: Path, dns: list[str], ips: list[tls.IpAddress]
) -> None:
    tls.generate(tmp_path, HOST, ADDRS, networks=NETS, now=NOW, group=NO_GROUP)
    _openssl_verify(tmp_path, tmp_path / "server.crt", expect_ok=True)  # control: the real one verifies
    _openssl_verify(tmp_path, _leaf(tmp_path, [HOST], [ipaddress.IPv4Address("10.0.2.99")], "ok.crt"), expect_ok=True)
    text = _openssl_verify(tmp_path, _leaf(tmp_path, dns, ips, "evil.crt"), expect_ok=False)
    assert "subtree violation" in text or "name constraint" in text.lower(), text


def test_renews_when_key_does_not_match_or_ca_replaced(tmp_path: Path) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    other = tmp_path / "other"
    tls.generate(other, HOST, ADDRS, now=NOW, group=NO_GROUP)
    shutil.copy(other / "server.key", tmp_path / "server.key")
    assert "does not match" in tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP).reason
    # A lost CA key: a new CA, and a server certificate signed by it.
    (tmp_path / "ca.key").unlink()
    result = tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    assert result.created_ca and result.renewed and "not signed" in result.reason
    assert _cert(tmp_path / "server.crt").issuer == _cert(tmp_path / "ca.crt").subject


@pytest.mark.programs
def test_host_addresses_include_loopback() -> None:
    found = tls.host_addresses()
    assert ipaddress.ip_address("127.0.0.1") in found and ipaddress.ip_address("::1") in found
    assert not any(ip.is_link_local for ip in found)


# ------------------------------------------------------------------------------ the command


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An appliance.json (internal mode) and a state directory for the real command."""
    cfg = tmp_path / "appliance.json"
    cfg.write_text(_appliance_json("internal", HOST))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(cfg))
    tls_dir = tmp_path / "state" / "tls"
    monkeypatch.setattr(paths, "TLS_DIR", tls_dir)
    monkeypatch.setattr(tls, "PROXY_GROUP", NO_GROUP)
    return tls_dir


@pytest.mark.programs
def test_cli_generate_then_show_prints_openssl_fingerprint(device: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tls", "generate", "--no-reload"]) == 0
    assert "created a new appliance CA" in capsys.readouterr().out
    assert main(["tls", "generate", "--no-reload"]) == 0
    assert "server certificate is current" in capsys.readouterr().out

    openssl = subprocess.run(
        ["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(device / "ca.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    expected = openssl.split("=", 1)[1]
    assert main(["tls"]) == 0
    out = capsys.readouterr().out
    assert expected in out
    assert str(device / "ca.crt") in out and HOST in out and "127.0.0.1" in out

    for argv in (["tls", "--json"], ["tls", "show", "--json"]):
        assert main(argv) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["ca_fingerprint_sha256"] == expected
        assert info["ca_certificate"] == str(device / "ca.crt")
        assert HOST in info["server_names"] and "::1" in info["server_names"]
        assert datetime.datetime.fromisoformat(info["server_not_after"]) > datetime.datetime.now(datetime.UTC)


def test_cli_show_before_generate_says_what_to_do(device: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tls", "show"]) == 2
    err = capsys.readouterr().err
    assert "no appliance CA" in err and "appliance-tls.service" in err


@pytest.mark.programs
def test_cli_generate_reloads_the_proxy_only_after_a_renewal(device: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(tls, "reload_proxy", lambda: calls.append(1))
    assert main(["tls", "generate"]) == 0
    assert calls == [1]
    assert main(["tls", "generate"]) == 0
    assert calls == [1], "nothing renewed: no reload"


def test_cli_acme_mode_is_a_no_op(tmp_path: Path, device: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "appliance.json").write_text(_appliance_json("acme", "dsv4.example.net"))
    assert main(["tls", "generate"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    # no appliance CA or server certificate; only the journal upload's client identity
    assert sorted(p.name for p in device.iterdir()) == ["client.crt", "client.key"]
    assert main(["tls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"mode": "acme", "hostname": "dsv4.example.net"}


# ------------------------------------------------------------------ the journal upload's client identity


def test_the_client_certificate_is_made_once_for_client_auth_and_renewed_for_another_host(tmp_path: Path) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    assert tls.ensure_client(tmp_path, "gpu-07", now) == "no client certificate yet"
    files = tls.Files(tmp_path)
    cert = x509.load_pem_x509_certificate(files.client_crt.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-07"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert stat.S_IMODE(files.client_key.stat().st_mode) == 0o600
    first = files.client_crt.read_bytes()
    assert tls.ensure_client(tmp_path, "gpu-07", now) is None and files.client_crt.read_bytes() == first
    assert "another host" in (tls.ensure_client(tmp_path, "gpu-08", now) or "")
    later = now + datetime.timedelta(days=tls.CLIENT_DAYS - tls.RENEW_DAYS + 2)
    assert tls.ensure_client(tmp_path, "gpu-08", later) == "the client certificate expires soon"
