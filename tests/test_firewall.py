# SPDX-License-Identifier: MIT
"""The appliance firewall (units/appliance-firewall.nft.j2, loaded by appliance-firewall.service).

The rendered ruleset is checked by the real `nft -c`, then loaded into a network namespace that
plays the appliance: a client namespace on one veth, a "container" namespace behind a bridge-side
veth in podman's 10.88.0.0/16. The proxy's ports answer; the engine port, SSH without keys, any
other port and the container network refuse (time out: dropped), with the same probes answering
before the rules are loaded as the control. Tables of other owners (netavark's) are never touched.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import config
from appliance.config import Config
from builder import engine_store, render

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
TOML = ROOT / "appliance.toml"
NFT = shutil.which("nft") or "/usr/sbin/nft"
IP = shutil.which("ip") or "/usr/sbin/ip"
UNIT = ROOT / "units/appliance-firewall.service"
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHn8lnFfhU0vuJ1c9Qq1Ikq6xcbp7Xh1SYmC8Zl6kz2H ops@example.net"

needs_nft = pytest.mark.skipif(not os.access(NFT, os.X_OK), reason="needs nft (apt install nftables)")


def _config(profile: str = "production", *, ssh: bool = False, http: str | None = None) -> Config:
    c = config.load(TOML, profile)
    if ssh:
        c = dataclasses.replace(c, os=dataclasses.replace(c.os, ssh_authorized_keys=(SSH_KEY,)))
    if http:
        c = dataclasses.replace(c, proxy=dataclasses.replace(c.proxy, http=http))
    return c


def _ruleset(c: Config) -> str:
    return render.render_template("appliance-firewall.nft.j2", c)


def _input_rules(text: str) -> str:
    return text[text.index("chain input {") : text.index("chain forward {")]


# ------------------------------------------------------------------------------ text


@pytest.mark.parametrize("profile", ["production", "demo"])
def test_only_its_own_table_is_touched(profile: str) -> None:
    text = _ruleset(_config(profile))
    statements = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert statements[:3] == ["table inet appliance", "delete table inet appliance", "table inet appliance {"]
    assert "flush" not in text.replace("`flush ruleset`", "")
    assert re.findall(r"^\s*(?:table|delete table)\s+(\S+\s+\S+)", text, re.M) == ["inet appliance"] * 3


@pytest.mark.parametrize(
    ("ssh", "http", "ports"),
    [(False, "redirect", "{ 80, 443 }"), (False, "close", "443"), (True, "redirect", "{ 80, 443 }")],
)
def test_input_admits_only_the_proxy_and_ssh_with_keys(ssh: bool, http: str, ports: str) -> None:
    rules = _input_rules(_ruleset(_config(ssh=ssh, http=http)))
    assert "policy drop;" in rules
    assert re.findall(r"tcp dport (.+) accept", rules) == [ports, "9443", *(["22"] if ssh else [])]
    assert "8000" not in rules


def test_https_port_follows_the_configuration() -> None:
    c = _config(http="close")
    c = dataclasses.replace(c, proxy=dataclasses.replace(c.proxy, https_port=8443))
    assert re.findall(r"tcp dport (.+) accept", _input_rules(_ruleset(c))) == ["8443", "9443"]


def test_rendered_into_the_image_where_the_unit_loads_it(tmp_path: Path) -> None:
    c = _config()
    erofs, verity = tmp_path / "e.erofs", tmp_path / "e.verity"
    erofs.write_bytes(b"e")
    verity.write_bytes(b"v")
    store = engine_store.EngineStore(erofs, verity, "ab" * 32, engine_store.label_for(c.engine.digest))
    render.render_units(c, tmp_path / "tree", store)
    unit = (tmp_path / "tree/usr/lib/systemd/system/appliance-firewall.service").read_text()
    (loaded,) = re.findall(r"^ExecStart=/usr/sbin/nft -f (\S+)$", unit, re.M)
    assert (tmp_path / "tree" / loaded.lstrip("/")).read_text() == _ruleset(c)
    preset = (tmp_path / "tree/usr/lib/systemd/system-preset/10-appliance.preset").read_text()
    assert "enable appliance-firewall.service" in preset.splitlines()
    assert "disable nftables.service" in preset.splitlines()  # its /etc/nftables.conf flushes the ruleset


def test_unit_runs_before_the_network_and_never_opens_on_stop() -> None:
    unit = UNIT.read_text()
    assert re.search(r"^Before=.*\bnetwork-pre\.target\b", unit, re.M)
    assert re.search(r"^Wants=network-pre\.target$", unit, re.M)
    assert "DefaultDependencies=no" in unit and not re.search(r"^ExecStop", unit, re.M)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_unit_exposure_at_most_3() -> None:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True, text=True)
    (score,) = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert float(score) <= 3.0, out.stdout


@needs_nft
@pytest.mark.parametrize("profile", ["production", "demo"])
@pytest.mark.parametrize("ssh", [False, True])
def test_nft_accepts_the_ruleset(tmp_path: Path, profile: str, ssh: bool) -> None:
    path = tmp_path / "appliance-firewall.nft"
    path.write_text(_ruleset(_config(profile, ssh=ssh)))
    out = subprocess.run([NFT, "-c", "-f", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # and a broken ruleset is refused (the check can fail)
    path.write_text(_ruleset(_config(profile)).replace("policy drop;", "policy dropp;", 1))
    assert subprocess.run([NFT, "-c", "-f", str(path)], capture_output=True, text=True).returncode != 0


# ------------------------------------------------------------------------------ live, in namespaces

LISTEN = textwrap.dedent(
    """
    import socket, sys, threading
    def serve(port):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(16)
        while True:
            c, _ = s.accept()
            c.sendall(b"hello")
            c.close()
    for p in sys.argv[1:]:
        threading.Thread(target=serve, args=(int(p),), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()
    """
)

PROBE = textwrap.dedent(
    """
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
            print("open" if s.recv(5) == b"hello" else "odd")
    except socket.timeout:
        print("dropped")
    except ConnectionRefusedError:
        print("refused")
    except OSError as e:
        print(f"error {e.errno}")
    """
)


@dataclasses.dataclass
class Net:
    appliance: str
    client: str
    container: str
    procs: list[subprocess.Popen[str]]

    def run(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([IP, "netns", "exec", ns, *argv], capture_output=True, text=True, check=check, timeout=30)

    def listen(self, ns: str, *ports: int) -> None:
        proc = subprocess.Popen(
            [IP, "netns", "exec", ns, sys.executable, "-c", LISTEN, *map(str, ports)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"

    def probe(self, ns: str, address: str, port: int, timeout: float = 1.0) -> str:
        return self.run(ns, sys.executable, "-c", PROBE, address, str(port), str(timeout)).stdout.strip()

    def load(self, c: Config, tmp_path: Path) -> None:
        path = tmp_path / "appliance-firewall.nft"
        path.write_text(_ruleset(c))
        self.run(self.appliance, NFT, "-f", str(path))


def _ip(*argv: str) -> None:
    subprocess.run([IP, *argv], check=True, capture_output=True, text=True)


@pytest.fixture
def net() -> Iterator[Net]:
    if not os.access(NFT, os.X_OK):
        pytest.skip("needs nft")
    tag = f"fw{os.getpid() % 100000}"
    n = Net(f"{tag}-app", f"{tag}-cli", f"{tag}-ctr", [])
    try:
        subprocess.run([IP, "netns", "add", n.appliance], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        _ip("netns", "add", n.client)
        _ip("netns", "add", n.container)
        # client <-> appliance (192.0.2.0/24); appliance <-> container (podman's 10.88.0.0/16)
        _ip("link", "add", "fwa0", "netns", n.appliance, "type", "veth", "peer", "fwc0", "netns", n.client)
        _ip("link", "add", "fwb0", "netns", n.appliance, "type", "veth", "peer", "fwk0", "netns", n.container)
        for ns, dev, addr in (
            (n.appliance, "fwa0", "192.0.2.1/24"),
            (n.client, "fwc0", "192.0.2.2/24"),
            (n.appliance, "fwb0", "10.88.0.1/16"),
            (n.container, "fwk0", "10.88.0.2/16"),
        ):
            n.run(ns, IP, "addr", "add", addr, "dev", dev)
            n.run(ns, IP, "link", "set", dev, "up")
            n.run(ns, IP, "link", "set", "lo", "up")
        n.run(n.client, IP, "route", "add", "10.88.0.0/16", "via", "192.0.2.1")
        n.run(n.container, IP, "route", "add", "default", "via", "10.88.0.1")
        n.run(n.appliance, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield n
    finally:
        for proc in n.procs:
            proc.kill()
            proc.wait()
        for ns in (n.appliance, n.client, n.container):
            subprocess.run([IP, "netns", "del", ns], capture_output=True)


NETAVARK = """
table inet netavark {
    chain forward { type filter hook forward priority filter; policy accept; ip daddr 10.88.0.0/16 accept; }
}
table ip nat {
    chain postrouting { type nat hook postrouting priority srcnat; ip saddr 10.88.0.0/16 masquerade; }
}
"""


def _foreign_tables(net: Net) -> str:
    text = net.run(net.appliance, NFT, "list", "ruleset").stdout
    return re.sub(r"(?s)table inet appliance \{.*?\n\}\n?", "", text)


def test_only_the_proxy_is_reachable_from_the_network(net: Net, tmp_path: Path) -> None:
    app, cli, ctr = net.appliance, net.client, net.container
    net.listen(app, 443, 80, 8000, 22, 9999)
    net.listen(ctr, 8000)
    net.listen(cli, 7000)
    (tmp_path / "netavark.nft").write_text(NETAVARK)
    net.run(app, NFT, "-f", str(tmp_path / "netavark.nft"))
    foreign = _foreign_tables(net)
    assert "table inet netavark" in foreign and "masquerade" in foreign

    # Control: without the firewall every probe answers (routes and listeners work).
    for port in (443, 80, 8000, 22, 9999):
        assert net.probe(cli, "192.0.2.1", port) == "open", port
    assert net.probe(cli, "10.88.0.2", 8000) == "open"

    net.load(_config("production"), tmp_path)
    net.load(_config("production"), tmp_path)  # reloading replaces its own table, nothing else
    assert _foreign_tables(net) == foreign, "netavark's tables must stay as they were"
    assert net.run(app, NFT, "list", "tables").stdout.count("table inet appliance") == 1

    assert net.probe(cli, "192.0.2.1", 443) == "open"
    assert net.probe(cli, "192.0.2.1", 80) == "open"  # production: http = "redirect"
    for port in (8000, 22, 9999):
        assert net.probe(cli, "192.0.2.1", port) == "dropped", port
    # Nothing new from the network into the container bridge, the engine's port included ...
    assert net.probe(cli, "10.88.0.2", 8000) == "dropped"
    assert net.probe(cli, "10.88.0.1", 8000) == "dropped"
    # ... while the host itself reaches the container, and the container the network.
    assert net.probe(app, "10.88.0.2", 8000) == "open"
    assert net.probe(app, "127.0.0.1", 8000) == "open"
    assert net.probe(ctr, "192.0.2.2", 7000) == "open"
    if shutil.which("ping"):  # ICMP echo still answers
        assert net.run(cli, "ping", "-c", "1", "-W", "2", "192.0.2.1", check=False).returncode == 0


def test_ssh_only_with_keys_and_port_80_only_with_redirect(net: Net, tmp_path: Path) -> None:
    cli = net.client
    net.listen(net.appliance, 443, 80, 22)
    net.load(_config("production", ssh=True, http="close"), tmp_path)
    assert net.probe(cli, "192.0.2.1", 22) == "open"
    assert net.probe(cli, "192.0.2.1", 443) == "open"
    assert net.probe(cli, "192.0.2.1", 80) == "dropped"
    net.load(_config("production", ssh=False, http="close"), tmp_path)
    assert net.probe(cli, "192.0.2.1", 22) == "dropped"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_loads_with_only_the_units_capability(net: Net, tmp_path: Path) -> None:
    """CapabilityBoundingSet=CAP_NET_ADMIN is enough for nft, and is needed (control: none fails)."""
    (bounding,) = re.findall(r"^CapabilityBoundingSet=(.+)$", UNIT.read_text(), re.M)
    assert bounding.split() == ["CAP_NET_ADMIN"]
    path = tmp_path / "appliance-firewall.nft"
    path.write_text(_ruleset(_config()))

    def load(caps: str) -> subprocess.CompletedProcess[str]:
        setpriv = ["setpriv", f"--bounding-set=-all{caps}", "--inh-caps=-all", "--no-new-privs"]
        return net.run(net.appliance, *setpriv, NFT, "-f", str(path), check=False)

    assert load("").returncode != 0
    done = load(",+net_admin")
    assert done.returncode == 0, done.stderr
    assert "table inet appliance" in net.run(net.appliance, NFT, "list", "tables").stdout
