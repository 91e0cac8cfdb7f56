# SPDX-License-Identifier: MIT
"""docs/install.md's section on provisioning systems (Metal3, Ironic, an HTTPS boot server) says
what the installer and the builder really do.

Each name the section relies on is checked against the code that owns it: the plan's credentials
and the ISO's label the installer reads, the media's file names and the ISO's plan/ the builder
writes (with its own command line, as the page prints it), a unit that starts by itself, reads no
key and prints its summary on tty1 only, the NICs the installer has drivers for, and the fields of
the page's YAML that a one-time boot and a single-disk install depend on.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

import builder.__main__
import installer.__main__
from appliance.signed import bundle_index, install_plan
from builder import installer_media
from installer import remote

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "install.md"
HEADING = "## 4. From a provisioning system"
UNIT = ROOT / "installer/mkosi/mkosi.extra/usr/lib/systemd/system/appliance-installer.service"
PRESET = ROOT / "installer/mkosi/mkosi.extra/usr/lib/systemd/system-preset/10-appliance-installer.preset"
MKOSI_CONF = ROOT / "installer/mkosi/mkosi.conf"


def _section(text: str | None = None) -> str:
    text = PAGE.read_text() if text is None else text
    assert HEADING in text, f"docs/install.md: no section {HEADING!r}"
    body = text.split(HEADING, 1)[1]
    return body.split("\n## ", 1)[0]


def _fenced(section: str, lang: str) -> list[str]:
    """The bodies of SECTION's fenced blocks marked LANG ("" for none), each opening paired with its close."""
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M) if m.group(1) == lang]


def _yaml_blocks(section: str) -> list[Any]:
    return [yaml.safe_load(block) for block in _fenced(section, "yaml")]


def _block(section: str, want: str) -> dict[str, Any]:
    found = [b for b in _yaml_blocks(section) if isinstance(b, dict) and want in b]
    assert len(found) == 1, f"docs/install.md section 4: {len(found)} YAML blocks with {want!r}, want 1"
    return found[0]


def _unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def _commands(section: str, prefix: str) -> list[list[str]]:
    lines = [line for block in _fenced(section, "sh") for line in block.splitlines()]
    return [shlex.split(line.split(" #")[0]) for line in lines if line.startswith(prefix)]


def _iso_url(section: str) -> str:
    return str(_block(section, "kind")["spec"]["image"]["url"])


# ------------------------------------------------------------------ what the installer reads


def test_the_plan_credentials_named_are_the_ones_the_unit_imports() -> None:
    section = _section()
    names = [installer.__main__.CREDENTIAL, f"{installer.__main__.CREDENTIAL}.sig", remote.CA_CREDENTIAL]
    for name in names:
        assert f"`{name}`" in section, f"docs/install.md section 4 does not name the credential {name}"
    (pattern,) = _unit()["ImportCredential"]
    assert all(fnmatch.fnmatchcase(name, pattern) for name in names), pattern
    assert f"`ImportCredential={pattern}`" in section


def test_the_medium_labels_named_are_the_ones_the_installer_mounts() -> None:
    section = _section()
    for label in ("APPLIANCE_INSTALLER", installer_media.PAYLOAD_LABEL):
        assert f"`{label}`" in section
        assert any(device.endswith("/" + label) for device in installer.__main__.MEDIUM_LABELS), label


def test_without_credentials_the_plan_is_the_medium_it_booted_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The page: the plan comes from --plan, the credentials, or plan/ on the medium booted from; nothing else.
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert installer.__main__.find_plan(tmp_path, None) == tmp_path / "plan"
    with pytest.raises(Exception) as refused:
        installer.__main__.find_plan(None, None)
    assert refused.value is installer.__main__.NO_RELEASE
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / installer.__main__.CREDENTIAL).write_text("{}")
    (creds / f"{installer.__main__.CREDENTIAL}.sig").write_text("sig")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    staged = installer.__main__.find_plan(None, None)
    assert (staged / install_plan.PLAN_JSON).read_text() == "{}"
    assert (staged / install_plan.PLAN_SIG).read_text() == "sig"


def console_reads(source: str) -> list[str]:
    """What in SOURCE (Python) would wait for a person: input(), getpass, sys.stdin, a tty opened."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "input":
            found.append(f"input() at line {node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr == "stdin":
            found.append(f"stdin at line {node.lineno}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {m} at line {node.lineno}" for m in modules if m.split(".")[0] in ("getpass", "termios", "tty")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"/dev/(tty\d*|console)", node.value):
            found.append(f"{node.value} at line {node.lineno}")
    return found


def test_the_console_check_finds_what_would_wait_for_a_person() -> None:
    sample = "import getpass\nimport sys\nanswer = input('type yes: ')\nline = sys.stdin.readline()\nopen('/dev/tty1')\n"
    assert len(console_reads(sample)) == 4
    assert console_reads("print('installer: done')\n") == []


def test_the_installer_reads_no_key_and_starts_by_itself() -> None:
    for path in sorted((ROOT / "installer").glob("*.py")):
        assert console_reads(path.read_text()) == [], f"{path.relative_to(ROOT)} waits for a person at the console"
    unit = _unit()
    assert unit.get("StandardInput", ["null"]) == ["null"], "the installer's unit reads its input from a console"
    assert unit["WantedBy"] == ["multi-user.target"] and unit["Type"] == ["oneshot"]
    assert "enable appliance-installer.service" in PRESET.read_text().splitlines()
    section = _section()
    assert "`appliance-installer.service`, wanted by `multi-user.target`" in section


def test_the_summary_goes_to_tty1_only_as_the_page_says() -> None:
    unit = _unit()
    assert unit["StandardOutput"] == ["tty"] and unit["TTYPath"] == ["/dev/tty1"]
    assert "goes to tty1 only" in _section()


def test_the_login_prompt_on_that_console_waits_for_the_install() -> None:
    # a getty started beside the installer takes its terminal over, and the install stops silently
    unit = _unit()
    tty = unit["TTYPath"][0].removeprefix("/dev/")
    assert f"getty@{tty}.service" in " ".join(unit.get("Before", [])).split(), unit.get("Before")


def test_the_nics_named_are_the_ones_the_installer_has_drivers_for() -> None:
    section = _section()
    named = re.search(r"drivers for ([\w, ]+) NICs", section.replace("\n", " "))
    assert named, "section 4 does not list the installer's NIC drivers"
    listed = set(re.split(r",\s*|\s+and\s+", named.group(1)))
    conf = MKOSI_CONF.read_text()
    line = next(line for line in conf.splitlines() if "e1000e" in line)
    assert listed == set(re.search(r"\(([\w|]+)\)", line).group(1).split("|")), (listed, line)  # type: ignore[union-attr]
    # and the RAM disk of an ISO booted over HTTP has no driver, as the page says
    assert "(nfit, nd_pmem)" in section and "nfit" not in conf and "nd_pmem" not in conf


# ------------------------------------------------------------------ what the builder writes


def test_the_per_host_iso_the_page_publishes_is_what_its_command_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = _section()
    (command,) = [c for c in _commands(section, "python3 -m builder installer") if "--form" in c]
    args = builder.__main__.build_parser().parse_args(command[3:])
    assert args.form == ["iso"] and args.plan and args.output
    version = re.search(r"installer_([\d.]+)\.iso", _iso_url(section)).group(1)  # type: ignore[union-attr]

    out = tmp_path / "out"  # a build output that is its own bundle directory
    out.mkdir()
    for name in (*bundle_index.install_names(version).values(), "manifest.json", "manifest.json.sig",
                 bundle_index.BUNDLE_INDEX, bundle_index.BUNDLE_SIG):
        (out / name).write_text(name)
    plan = tmp_path / args.plan
    plan.mkdir(parents=True)
    (plan / install_plan.PLAN_JSON).write_text("{}")
    (plan / install_plan.PLAN_SIG).write_text("sig")
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ")
    calls: list[list[str]] = []

    def record(argv: Sequence[str | Path], what: str, hint: str, input_text: str | None = None) -> str:
        words = [str(a) for a in argv]
        calls.append(words)
        if words[0] == "xorriso":
            Path(words[words.index("-o") + 1]).write_bytes(b"ISO")
        if words[0] == "cp":
            Path(words[-1]).write_bytes(Path(words[-2]).read_bytes())
        return ""

    monkeypatch.setattr(installer_media, "_run", record)
    written = installer_media.make(out, version, uki, plan, tmp_path / args.output, args.form, out)
    assert list(written) == ["iso"]
    published = re.search(r"Publish `([^`]+)`", section).group(1)  # type: ignore[union-attr]
    assert written["iso"] == tmp_path / published
    assert Path(published).name == Path(_iso_url(section)).name
    (xorriso,) = [c for c in calls if c[0] == "xorriso"]
    assert xorriso[xorriso.index("-V") + 1] == "APPLIANCE_INSTALLER"
    staged = Path(xorriso[-1])
    copied = {Path(c[-1]).relative_to(staged).as_posix() for c in calls if c[0] == "cp"}
    assert {f"plan/{install_plan.PLAN_JSON}", f"plan/{install_plan.PLAN_SIG}"} <= copied


def test_the_efi_form_named_for_http_boot_is_the_builders() -> None:
    section = _section()
    assert "`python3 -m builder installer --form efi`" in section
    urls = re.findall(r"https://\S+/(installer_[\d.]+\.efi)", section)
    assert urls and all(re.fullmatch(r"installer_[\d.]+\.efi", u) for u in urls)
    assert "installer_{version}.{" in Path(installer_media.__file__).read_text()  # make()'s naming of every form


# ------------------------------------------------------------------ the provisioning systems' own fields


def test_the_metal3_host_boots_the_per_host_iso_once_on_its_own_disk() -> None:
    section = _section()
    host = _block(section, "kind")
    assert host["apiVersion"] == "metal3.io/v1alpha1" and host["kind"] == "BareMetalHost"
    spec = host["spec"]
    assert spec["image"]["format"] == "live-iso" and spec["image"]["url"].startswith("https://")
    assert spec["online"] is True
    assert spec["bootMode"] == "UEFI"  # UEFISecureBoot would turn Secure Boot on: the installer needs setup mode
    assert spec["automatedCleaningMode"] == "disabled"  # the default erases every disk, not only the plan's target
    assert host["metadata"]["annotations"]["inspect.metal3.io"] == "disabled"
    scheme = spec["bmc"]["address"].split("://", 1)[0]
    assert scheme in ("redfish-virtualmedia", "idrac-virtualmedia")
    assert "idrac-virtualmedia://" in section  # Dell's, since redfish-virtualmedia must not be used there
    assert "password" not in str(spec).lower()
    (secret,) = [c for c in _commands(section, "kubectl create secret")]
    assert secret[4] == spec["bmc"]["credentialsName"]
    assert "--from-file=password=" in " ".join(secret) and not any(w.startswith("--from-literal=password") for w in secret)
    assert "`LIVE_ISO_FORCE_PERSISTENT_BOOT_DEVICE=Never`" in section


def test_the_ironic_node_boots_the_same_iso_once_with_the_ramdisk_deploy() -> None:
    section = _section()
    (node,) = _block(section, "nodes")["nodes"]
    assert node["driver"] == "redfish"
    assert node["boot_interface"] == "redfish-virtual-media" and node["deploy_interface"] == "ramdisk"
    assert node["driver_info"]["force_persistent_boot_device"] == "Never"
    assert node["automated_clean"] is False
    assert node["properties"]["capabilities"] == "boot_mode:uefi"
    commands = _commands(section, "openstack baremetal")
    assert ["openstack", "baremetal", "create", "gpu-07-node.yaml"] in commands
    named = [c for c in commands if c[2] == "node"]
    assert named and all(node["name"] in c for c in named)
    (iso,) = [w.split("=", 1)[1] for c in named for w in c if w.startswith("boot_iso=")]
    assert iso == _iso_url(section)  # the same per-host ISO as Metal3's
    # manageable, setup mode by manual cleaning, available, the ISO named, deployed: in that order
    assert [c[3] for c in named if c[3] != "set"] == ["manage", "clean", "provide", "deploy"]
    assert [c[3] for c in named].index("set") == 3
    (clean,) = [c for c in named if c[3] == "clean"]
    (step,) = json.loads(clean[clean.index("--clean-steps") + 1])
    assert step == {"interface": "management", "step": "clear_secure_boot_keys"}


def test_the_http_boot_server_answers_httpclient_with_the_installer_uki() -> None:
    section = _section()
    blocks = _fenced(section, "")
    dhcpd = next(b for b in blocks if "class " in b)
    dnsmasq = next(b for b in blocks if "dhcp-boot=" in b)
    for config in (dhcpd, dnsmasq):
        assert config.count("HTTPClient") >= 2, config  # matched, and sent back (option 60)
        assert re.search(r"https://\S+/installer_[\d.]+\.efi", config), config
    assert "`UefiHttp`" in section and "`Once`" in section


def test_each_gap_is_said_where_it_applies() -> None:
    section = _section()
    parts = {h: section.split(f"### {h}", 1)[1].split("\n### ", 1)[0]
             for h in ("Metal3", "OpenStack Ironic", "A plain HTTPS boot server")}
    assert "What this needs to be one ISO for the rack" in parts["Metal3"]
    assert "the per-host ISO is the only way the plan gets there" in parts["OpenStack Ironic"]
    assert "What this needs on real hardware: the plan" in parts["A plain HTTPS boot server"]


def test_the_section_check_reads_the_page_it_is_given() -> None:
    # Guards against the section's extraction silently reading nothing.
    assert _section("intro\n## 4. From a provisioning system: x\nbody\n## On the appliance\nrest") == ": x\nbody"
    with pytest.raises(AssertionError):
        _section("no such section\n")
    assert len(_yaml_blocks(_section())) == 2
