# SPDX-License-Identifier: MIT
"""The install plan: checked like appliance.toml, signed with the release key, nothing unsigned
accepted; rendered on the device into systemd-networkd files that the real systemd-networkd parses
without a complaint (run in a private mount and network namespace on this host)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from plan_values import CA_PEM, HOSTILE, string_fields, string_leaves

import appliance.config
from appliance import host_settings
from appliance.errors import ConfigError, UserError
from appliance.host_settings import Update
from appliance.schema import CONTROL
from appliance.signed import install_plan, release_manifest
from applianctl import host
from builder import keys, sign_plan

REPO = Path(__file__).resolve().parents[1]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK0wmN/Cr3JXqmLW7u+g9pTh+wyqDHpSQEIQczXkVx9q ops@example.net"

BOND_VLAN = """
hostname = "gpu-07"
[network]
interfaces = ["ens1f0", "52:54:00:12:34:57"]
bond = "802.3ad"
vlan = 120
mtu = 9000
addresses = ["192.0.2.10/24", "2001:db8::10/64"]
gateways = ["192.0.2.1", "2001:db8::1"]
dns = ["192.0.2.53", "2001:db8::53"]
domains = ["example.net"]
ntp = ["ntp.example.net", "192.0.2.123"]
[ssh]
authorized_keys = ["KEY"]
[proxy]
hostname = "gpu-07.example.net"
allowed_cidrs = ["10.0.0.0/8"]
[update]
url = "https://updates.example.net/appliance/"
[target]
serial = "S64ANS0T512345"
min_size_gib = 100
""".replace("KEY", KEY)

STATIC = """
[network]
interfaces = ["enp65s0f0"]
addresses = ["192.0.2.10/24"]
gateways = ["192.0.2.1"]
dns = ["192.0.2.53"]
"""


def _plan(tmp_path: Path, text: str) -> install_plan.Plan:
    path = tmp_path / "plan.toml"
    path.write_text(textwrap.dedent(text))
    return install_plan.load_toml(path)


def _config() -> appliance.config.Config:
    return appliance.config.load(REPO / "appliance.toml", "demo")


# ------------------------------------------------------------------------------ checking


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('hostname = "Bad_Name"', "hostname = 'Bad_Name': invalid"),
        ('colour = "red"', "unknown key 'colour'"),
        ('[network]\ninterfaces = ["eth0"]\naddresses = ["192.0.2.10"]', "network.addresses[0] = '192.0.2.10': invalid"),
        ('[network]\ninterfaces = ["eth0"]\naddresses = ["192.0.2.10/24"]\ngateways = ["198.51.100.1"]',
         "outside every static address's network"),
        ('[network]\ninterfaces = ["eth0"]', "neither dhcp = true nor addresses"),
        ('[network]\ninterfaces = ["eth0", "eth1"]\ndhcp = true', "2 links without a bond"),
        ('[network]\ninterfaces = ["eth0"]\ndhcp = true\nbond = "802.3ad"', "needs at least two interfaces"),
        ('[network]\ninterfaces = ["eth0"]\ndhcp = true\nvlan = 4095', "network.vlan = 4095: invalid"),
        ('[network]\ninterfaces = ["eth0"]\ndhcp = true\nmtu = 100', "network.mtu = 100: invalid"),
        ('[network]\ninterfaces = ["eth0"]\naddresses = ["2001:db8::1/64"]\nmtu = 1000', "below IPv6's minimum"),
        ('[network]\ninterfaces = ["eth0;rm"]\ndhcp = true', "network.interfaces[0] = 'eth0;rm': invalid"),
        ('[network]\ninterfaces = ["eth0"]\ndhcp = true\ndns = ["192.0.2.53\\nDNS=1.1.1.1"]', "network.dns[0]"),
        ('[ssh]\nauthorized_keys = ["not a key"]', "ssh.authorized_keys[0]"),
        ('[target]\nmin_size_gib = 10', "target names no disk"),
        ('[target]\nserial = "S1"\nmin_size_gib = 10\nmax_size_gib = 5', "min_size_gib is larger"),
        ('[target]\nserial = "S1"\nwipe_existing_data = "yes"', "target.wipe_existing_data = 'yes': invalid"),
        ('[proxy]\nallowed_cidrs = ["10.0.0.1/8"]', "proxy.allowed_cidrs[0]"),
        ('[report]\nurl = "https://10.0.0.5:8443/"', "missing key 'report.ca'"),
        ('[report]\nurl = "http://10.0.0.5:8443/"\nca = ""', "report.url = 'http://10.0.0.5:8443/': invalid"),
        ('[report]\nurl = ""\nca = ""', "report.url = '': invalid"),
        ('[report]\nurl = "https://10.0.0.5:8443/"\nca = "not a certificate"', "report.ca = 'not a certificate': invalid"),
        (f'[report]\nurl = "https://10.0.0.5:8443/"\nca = """{CA_PEM}"""\nrecovery_recipient = "not a key"',
         "report.recovery_recipient = 'not a key': invalid"),
        (f'[report]\nurl = "https://10.0.0.5:8443/"\nca = """{CA_PEM}"""\nrecovery_recipient = """{CA_PEM}"""',
         "report.recovery_recipient = '-----BEGIN CERTIFICATE-----"),
    ],
)
def test_bad_plans_are_one_line_with_a_hint(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, text)
    assert message in e.value.message
    assert "\n" not in e.value.message and e.value.hint
    assert e.value.exit_status == 2


def test_the_image_defaults_apply_where_the_plan_is_silent(tmp_path: Path) -> None:
    config = _config()
    eff = _plan(tmp_path, STATIC).effective(config)
    assert eff["hostname"] == config.os.hostname
    assert eff["proxy_hostname"] == config.proxy.hostname
    assert eff["proxy_allowed_cidrs"] == list(config.proxy.allowed_cidrs)
    assert eff["ssh_authorized_keys"] == list(config.os.ssh_authorized_keys)
    full = _plan(tmp_path, BOND_VLAN).effective(config)
    assert (full["hostname"], full["proxy_hostname"], full["proxy_allowed_cidrs"]) == ("gpu-07", "gpu-07.example.net", ["10.0.0.0/8"])
    assert full["ssh_authorized_keys"] == [KEY]
    assert full["update_url"] == "https://updates.example.net/appliance/"


# ------------------------------------------------------------------------------ signing


@pytest.fixture
def release_keys(tmp_path: Path) -> tuple[Path, Path]:
    """A release key pair and the trusted-keys directory holding its public key."""
    private, public = keys.generate(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(public, trusted / "release.pub")
    return private, trusted


def test_signed_plan_round_trips_and_every_change_is_refused(tmp_path: Path, release_keys: tuple[Path, Path]) -> None:
    private, trusted = release_keys
    plan = _plan(tmp_path, BOND_VLAN)
    data, sig = install_plan.sign(plan, private)
    assert install_plan.verify(data, sig, trusted) == plan

    # one byte changed in the plan (the address), the signature, or the canonical form
    with pytest.raises(install_plan.PlanRefused, match="not signed by a key this release trusts"):
        install_plan.verify(data.replace(b"192.0.2.10/24", b"192.0.2.11/24"), sig, trusted)
    bad_sig = bytearray(sig)
    bad_sig[5] = ord("A") if bad_sig[5] != ord("A") else ord("B")
    with pytest.raises(install_plan.PlanRefused):
        install_plan.verify(data, bytes(bad_sig), trusted)
    # signed by another key: refused even though the signature itself is valid
    other, _ = keys.generate(tmp_path / "other")
    data2, sig2 = install_plan.sign(plan, other)
    with pytest.raises(install_plan.PlanRefused, match="not signed by a key this release trusts"):
        install_plan.verify(data2, sig2, trusted)


@pytest.mark.parametrize("signer", ["0123456789abcdef", None], ids=["another-key", "none"])
def test_a_plan_must_name_the_key_that_signed_it(tmp_path: Path, release_keys: tuple[Path, Path], signer: str | None) -> None:
    """Signed by a trusted key, but naming another signer (or none): refused, as the release
    manifest and the bundle index are."""
    private, trusted = release_keys
    doc = install_plan.to_document(_plan(tmp_path, STATIC), signer or "")
    if signer is None:
        del doc["signer"]
    data = release_manifest.canonical(doc)
    sig = release_manifest.encode_signature(release_manifest.load_private_key(private).sign(data))
    with pytest.raises(install_plan.PlanRefused, match="names another signer than the key that signed it") as e:
        install_plan.verify(data, sig, trusted)
    assert "\n" not in e.value.message and e.value.hint
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / install_plan.PLAN_JSON).write_bytes(data)
    (host_dir / install_plan.PLAN_SIG).write_bytes(sig)
    with pytest.raises(install_plan.PlanRefused, match="names another signer"):
        install_plan.load_signed(host_dir, trusted)


def test_an_unsigned_plan_is_refused_and_the_defaults_stay(tmp_path: Path, release_keys: tuple[Path, Path]) -> None:
    _, trusted = release_keys
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / install_plan.PLAN_JSON).write_bytes(install_plan.dumps(_plan(tmp_path, STATIC), "0" * 16))
    netdir, result = tmp_path / "run-network", tmp_path / "host.json"
    doc = host.apply(_config(), host_dir, netdir, result, trusted, set_hostname=False)
    assert doc.ok is False and "plan.json.sig: missing" in doc.reason
    assert list(netdir.iterdir()) == []
    assert json.loads(result.read_text())["source"] == "image defaults"


def test_apply_renders_the_signed_plan_and_replaces_an_older_rendering(tmp_path: Path, release_keys: tuple[Path, Path]) -> None:
    private, trusted = release_keys
    host_dir, netdir, result = tmp_path / "host", tmp_path / "run-network", tmp_path / "host.json"
    netdir.mkdir()
    (netdir / f"{host.PREFIX}-vlan99.netdev").write_text("stale")  # from an earlier boot's plan
    (netdir / "50-other.network").write_text("not ours")
    data, sig = install_plan.sign(_plan(tmp_path, BOND_VLAN), private)
    host_dir.mkdir()
    (host_dir / install_plan.PLAN_JSON).write_bytes(data)
    (host_dir / install_plan.PLAN_SIG).write_bytes(sig)
    doc = host.apply(_config(), host_dir, netdir, result, trusted, set_hostname=False)
    assert doc.ok is True and doc.source == "plan"
    names = sorted(p.name for p in netdir.iterdir())
    assert names == sorted([*doc.network_files, "50-other.network"])
    assert f"{host.PREFIX}-vlan99.netdev" not in names
    assert (host_dir / "authorized_keys").read_text() == KEY + "\n"
    assert json.loads((result.parent / host.HOST_SETTINGS).read_text())["proxy"]["hostname"] == "gpu-07.example.net"


# ------------------------------------------------------------------------------ rendering


def _ini(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a systemd ini file, in order."""
    out, section = [], ""
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.append((section, key, value))
    return out


def test_static_single_link(tmp_path: Path) -> None:
    files = host.network_files(_plan(tmp_path, STATIC).network)  # type: ignore[arg-type]
    assert list(files) == [f"{host.PREFIX}-uplink.network"]
    assert _ini(files[f"{host.PREFIX}-uplink.network"]) == [
        ("Match", "Name", "enp65s0f0"), ("Match", "Type", "ether"),
        ("Network", "DHCP", "no"), ("Network", "Address", "192.0.2.10/24"),
        ("Network", "Gateway", "192.0.2.1"), ("Network", "DNS", "192.0.2.53"),
    ]


def test_bond_with_vlan_and_jumbo_frames(tmp_path: Path) -> None:
    files = host.network_files(_plan(tmp_path, BOND_VLAN).network)  # type: ignore[arg-type]
    p = host.PREFIX
    assert sorted(files) == sorted([f"{p}-bond0.netdev", f"{p}-member0.network", f"{p}-member1.network",
                                    f"{p}-vlan120.netdev", f"{p}-uplink.network", f"{p}-vlan120.network"])
    bond = _ini(files[f"{p}-bond0.netdev"])
    assert ("NetDev", "Kind", "bond") in bond and ("Bond", "Mode", "802.3ad") in bond and ("NetDev", "MTUBytes", "9000") in bond
    assert ("Match", "MACAddress", "52:54:00:12:34:57") in _ini(files[f"{p}-member1.network"])
    assert ("Network", "Bond", "bond0") in _ini(files[f"{p}-member0.network"])
    assert ("VLAN", "Id", "120") in _ini(files[f"{p}-vlan120.netdev"])
    uplink = _ini(files[f"{p}-uplink.network"])
    assert ("Match", "Name", "bond0") in uplink and ("Network", "VLAN", "vlan120") in uplink
    assert not [kv for kv in uplink if kv[1] == "Address"]  # the addresses are on the VLAN only
    vlan = _ini(files[f"{p}-vlan120.network"])
    assert [v for s, k, v in vlan if k in ("Address", "Gateway")] == ["192.0.2.10/24", "2001:db8::10/64", "192.0.2.1", "2001:db8::1"]
    assert ("Network", "Domains", "example.net") in vlan and ("Network", "NTP", "192.0.2.123") in vlan


def _networkd_complaints(files: dict[str, str], tmp_path: Path) -> tuple[list[str], str]:
    """Run the host's real systemd-networkd for a few seconds in a private mount and network
    namespace with FILES as its only configuration; the lines in which it names one of them."""
    netdir = tmp_path / "net"
    netdir.mkdir()
    for name, text in files.items():
        (netdir / name).write_text(text)
    script = f"""
set -e
for d in /run/systemd/network /etc/systemd/network /run/systemd/netif; do mkdir -p $d; mount -t tmpfs -o mode=0755 tmpfs $d; done
cp {netdir}/* /run/systemd/network/
ip link add ens1f0 type veth peer name ens1f1 2>/dev/null || true
SYSTEMD_LOG_LEVEL=debug SYSTEMD_LOG_TARGET=console timeout 3 /lib/systemd/systemd-networkd 2>&1 || true
"""
    proc = subprocess.run(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30, check=False)
    out = proc.stdout + proc.stderr
    return [line for line in out.splitlines() if "/run/systemd/network/" in line], out


networkd = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/lib/systemd/systemd-networkd").exists() or shutil.which("unshare") is None,
    reason="needs root, unshare and systemd-networkd",
)


DHCP_AND_V6 = '[network]\ninterfaces = ["eth0"]\ndhcp = true\nmtu = 1500\naddresses = ["2001:db8::5/64"]'


@pytest.mark.programs
@networkd
@pytest.mark.parametrize("text", [STATIC, BOND_VLAN, DHCP_AND_V6])
def test_real_networkd_reads_the_rendered_files_without_a_complaint(tmp_path: Path, text: str) -> None:
    files = host.network_files(_plan(tmp_path, text).network)  # type: ignore[arg-type]
    complaints, out = _networkd_complaints(files, tmp_path)
    assert "Registering bus object" in out or "Bus bus-api-network" in out, out[-2000:]  # networkd really ran
    assert complaints == [], complaints
    if "bond" in text:
        assert 'bond0: loaded "bond"' in out and 'vlan120: loaded "vlan"' in out, out[-2000:]


@pytest.mark.programs
@networkd
def test_the_networkd_check_can_fail(tmp_path: Path) -> None:
    complaints, _ = _networkd_complaints({"05-bad.network": "[Match]\nName=x\n[Network]\nAdress=192.0.2.1/24\nVLAN=\n"}, tmp_path)
    assert any("Unknown key" in c for c in complaints), complaints


# ------------------------------------------------------------------------------ status


def test_status_part_host_follows_what_apply_wrote(tmp_path: Path, release_keys: tuple[Path, Path]) -> None:
    import applianctl.status.host
    from applianctl.status import probes
    def ip(argv: object, timeout: float) -> tuple[int, str]:
        return 0, json.dumps([{"ifname": "vlan120", "addr_info": [{"local": "192.0.2.10", "prefixlen": 24}]}])

    src = probes.Sources(run=ip)
    config, result = _config(), tmp_path / "host.json"
    absent = applianctl.status.host.probe_host(config, src, result)
    assert absent.state == probes.NOT_CONFIGURED and absent.to_json()["settings"]["hostname"] == config.os.hostname

    private, trusted = release_keys
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    data, sig = install_plan.sign(_plan(tmp_path, BOND_VLAN), private)
    (host_dir / install_plan.PLAN_JSON).write_bytes(data)
    (host_dir / install_plan.PLAN_SIG).write_bytes(sig)
    host.apply(config, host_dir, tmp_path / "net", result, trusted, set_hostname=False)
    ok = applianctl.status.host.probe_host(config, src, result)
    assert ok.state == probes.OK and ok.to_json()["source"] == "plan" and ok.to_json()["addresses"] == ["192.0.2.10/24"]
    assert ok.to_json()["settings"]["network"] == (
        "bond0 (802.3ad: ens1f0, 52:54:00:12:34:57), VLAN 120, MTU 9000: 192.0.2.10/24, 2001:db8::10/64 via 192.0.2.1, 2001:db8::1")

    (host_dir / install_plan.PLAN_JSON).write_bytes(data.replace(b"gpu-07", b"gpu-08"))  # changed after signing
    host.apply(config, host_dir, tmp_path / "net", result, trusted, set_hostname=False)
    refused = applianctl.status.host.probe_host(config, src, result)
    assert refused.state == probes.DEGRADED and "not signed by a key this release trusts" in refused.reason
    assert refused.to_json()["settings"]["hostname"] == config.os.hostname  # the image's defaults apply


# ------------------------------------------------------------------------------ control characters


def _with(doc: dict[str, Any], n: int, f: Callable[[str], str]) -> dict[str, Any]:
    """DOC with its Nth string (plan_values.string_leaves' order) replaced by F of it."""
    doc = copy.deepcopy(doc)
    _, container, index = list(string_leaves(doc))[n]
    container[index] = f(container[index])  # type: ignore[index]
    return doc


@pytest.mark.parametrize("char", ["\x00", "\x0b", "\x1b", "\x1f", "\x7f", "\x80", "\x85", "\x9b", "\x9f"])
def test_a_control_character_in_any_string_of_the_plan_is_refused(char: str) -> None:
    leaves = list(string_leaves(HOSTILE))
    assert {key.split("[")[0] for key, _, _ in leaves} == string_fields()  # every string field of the plan is tried
    assert install_plan.from_plain(HOSTILE, "plan.json")
    for n, (key, _, _) in enumerate(leaves):
        for f in (lambda v: v + char, lambda v: v[:1] + char + v[1:]):
            with pytest.raises(ConfigError) as e:
                install_plan.from_plain(_with(HOSTILE, n, f), "plan.json")
            # refused by the loader's walk over every string, whatever the field's own check says
            assert f"plan.json: {key} = " in e.value.message and "text without control characters" in e.value.hint, key
            assert not CONTROL.search(e.value.message + e.value.hint)  # shown escaped, never raw on a console


def test_the_walk_refuses_control_characters_where_no_field_check_would() -> None:
    from appliance import schema

    @dataclass(frozen=True)
    class Free:
        text: str = ""
        texts: tuple[str, ...] = ()
        inner: Update | None = None

    doc = {"text": "a\x1bb", "texts": ["ok"], "inner": {"url": ""}}
    assert schema.Loader("doc").load(Free, doc).text == "a\x1bb"  # an unchecked field takes anything...
    for bad in (doc, {"texts": ["ok", "\x00"]}, {"inner": {"url": "\x85"}}):
        with pytest.raises(UserError, match="invalid") as e:  # ...but not in a printable document
            install_plan._PlanLoader(Path("doc")).load(Free, bad)
        assert "control characters" in e.value.hint


@pytest.mark.parametrize("char", ["\x0b", "\x00", "\x1b"])
def test_a_key_with_a_control_character_is_refused_from_toml_and_from_a_signed_plan(
        tmp_path: Path, release_keys: tuple[Path, Path], char: str) -> None:
    escaped = f"\\u{ord(char):04x}"
    with pytest.raises(ConfigError, match=r"ssh.authorized_keys\[0\]"):
        _plan(tmp_path, f'[ssh]\nauthorized_keys = ["{KEY}{escaped}[2J"]')
    # signed as it is (a Plan made in code skips the loader): the device still refuses it
    private, trusted = release_keys
    plan = install_plan.Plan(ssh=host_settings.Ssh(authorized_keys=(f"{KEY}{char}[2J",)))
    data, sig = install_plan.sign(plan, private)
    with pytest.raises(ConfigError, match=r"ssh.authorized_keys\[0\]"):
        install_plan.verify(data, sig, trusted)


# ------------------------------------------------------------------------------ size


def test_builder_plan_signs_the_largest_plan_the_device_reads_and_no_larger(
        tmp_path: Path, release_keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    private, trusted = release_keys
    key = release_manifest.load_private_key(private)
    signer = release_manifest.key_id(key.public_key())

    def toml(comment_bytes: int) -> Path:
        path = tmp_path / f"plan-{comment_bytes}.toml"
        path.write_text(f'[ssh]\nauthorized_keys = ["{KEY} {"x" * comment_bytes}"]\n')
        return path

    exact = install_plan.MAX_PLAN_BYTES - len(install_plan.dumps(install_plan.load_toml(toml(1)), signer)) + 1
    out = tmp_path / "signed"
    plan = sign_plan.write(toml(exact), private, out, _config())
    assert len((out / install_plan.PLAN_JSON).read_bytes()) == install_plan.MAX_PLAN_BYTES
    assert install_plan.load_signed(out, trusted) == plan  # the device reads the largest plan builder signs

    # a byte more: `builder plan` refuses it, writing nothing (it was signed, then refused by the device)
    with pytest.raises(ConfigError, match=f"more than the {install_plan.MAX_PLAN_BYTES} the appliance reads") as e:
        sign_plan.write(toml(exact + 1), private, tmp_path / "too-large", _config())
    assert "\n" not in e.value.message and e.value.hint and e.value.exit_status == 2
    assert not (tmp_path / "too-large").exists()
    # and the device refuses a plan that large even when a trusted key signed it
    big = install_plan.dumps(install_plan.load_toml(toml(exact + 1)), signer)
    big_sig = release_manifest.encode_signature(key.sign(big))
    with pytest.raises(install_plan.PlanRefused, match=f"{len(big)} bytes, more than {install_plan.MAX_PLAN_BYTES}"):
        install_plan.verify(big, big_sig, trusted)
    (out / install_plan.PLAN_JSON).write_bytes(big)
    (out / install_plan.PLAN_SIG).write_bytes(big_sig)
    with pytest.raises(install_plan.PlanRefused, match="more than"):
        install_plan.load_signed(out, trusted)

    # one constant: lowered, both sides follow
    monkeypatch.setattr(install_plan, "MAX_PLAN_BYTES", install_plan.MAX_PLAN_BYTES - 1)
    with pytest.raises(ConfigError, match="more than"):
        sign_plan.write(toml(exact), private, tmp_path / "lowered", _config())
    data = install_plan.dumps(plan, signer)
    with pytest.raises(install_plan.PlanRefused, match="more than"):
        install_plan.verify(data, release_manifest.encode_signature(key.sign(data)), trusted)


# ------------------------------------------------------------------------------ what the plan itself refuses


@pytest.mark.parametrize(("doc", "key"), [
    ({"proxy": {"allowed_cidrs": []}}, "proxy.allowed_cidrs is empty"),
    ({"proxy": {"acme_email": "ops@Example.net"}}, "proxy.acme_email"),
    ({"hostname": "a" * 61 + ".net"}, "hostname"),
])
def test_values_no_image_could_render_are_refused_by_the_plan_itself(doc: dict[str, Any], key: str) -> None:
    """Checked without any image's configuration (the installer checks a plan so): an empty
    allowlist, an e-mail domain in upper case (the Caddyfile's form is lower case), a host name
    longer than the kernel takes."""
    with pytest.raises(ConfigError) as e:
        install_plan.from_plain(doc, "plan.toml")
    assert key in e.value.message and "\n" not in e.value.message and e.value.hint
