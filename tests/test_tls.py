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

from appliance import paths
from appliance.errors import UserError
from applianctl import __main__ as applianctl_main
from applianctl import tls

HOST = "appliance.local"
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
    assert applianctl_main.COMMAND_MODULES["tls"] == "applianctl.tls"


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


@pytest.mark.parametrize(
    ("hostname", "addresses"),
    [
        ("other.local", ADDRS),
        (HOST, [*ADDRS, ipaddress.IPv4Address("192.0.2.9")]),
        (HOST, ADDRS[:2]),
    ],
)
def test_renews_when_names_change(tmp_path: Path, hostname: str, addresses: list[tls.IpAddress]) -> None:
    tls.generate(tmp_path, HOST, ADDRS, now=NOW, group=NO_GROUP)
    result = tls.generate(tmp_path, hostname, addresses, now=NOW + datetime.timedelta(days=1), group=NO_GROUP)
    assert result.renewed and "names changed" in result.reason
    dns, ips = tls.san_names(_cert(tmp_path / "server.crt"))
    assert dns == [hostname] and sorted(map(str, ips)) == sorted(map(str, addresses))


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


def test_host_addresses_include_loopback() -> None:
    found = tls.host_addresses()
    assert ipaddress.ip_address("127.0.0.1") in found and ipaddress.ip_address("::1") in found
    assert not any(ip.is_link_local for ip in found)


# ------------------------------------------------------------------------------ the command


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An appliance.json (internal mode) and a state directory for the real command."""
    cfg = tmp_path / "appliance.json"
    cfg.write_text(json.dumps({"proxy": {"tls": "internal", "hostname": HOST}}))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(cfg))
    tls_dir = tmp_path / "state" / "tls"
    monkeypatch.setattr(paths, "TLS_DIR", tls_dir)
    monkeypatch.setattr(tls, "PROXY_GROUP", NO_GROUP)
    return tls_dir


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


def test_cli_generate_reloads_the_proxy_only_after_a_renewal(device: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(tls, "reload_proxy", lambda: calls.append(1))
    assert main(["tls", "generate"]) == 0
    assert calls == [1]
    assert main(["tls", "generate"]) == 0
    assert calls == [1], "nothing renewed: no reload"


def test_cli_acme_mode_is_a_no_op(tmp_path: Path, device: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "appliance.json").write_text(json.dumps({"proxy": {"tls": "acme", "hostname": "dsv4.example.net"}}))
    assert main(["tls", "generate"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert not device.exists()
    assert main(["tls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"mode": "acme", "hostname": "dsv4.example.net"}
