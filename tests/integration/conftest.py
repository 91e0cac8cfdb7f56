# SPDX-License-Identifier: MIT
"""Integration fixtures: build the demo image once per session and boot it in QEMU (TCG)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attest_host
import netprobe
import pytest
from journey import V1, V2, V3, oopsed_before_userspace, reports_of
from signed_images import foreign_signed

from appliance import config, luks
from appliance.errors import UserError
from applianctl import tls
from builder import build, keys, qemu, release
from testkit.standin import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_config() -> config.Config:
    return config.load(ROOT / "appliance.toml", "demo")


@pytest.fixture(scope="session")
def demo_image(demo_config: config.Config) -> Path:
    """The demo image, built through the builder exactly as `make demo` builds it."""
    return build.build(demo_config).disk_image


# ------------------------------------------------------------------------- the upgrade journey
# One appliance lives through everything, so that no boot is spent twice under emulation:
#
#   run 1  boot A  v1 (1.0.0), first boot: the first look (with the engine's environment), the
#                  host probes the appliance from its network (only the proxy answers), the
#                  engine fault scenarios, a drop-in for the engine placed in /etc (verify names
#                  it; the next boot's initrd removes it), then `applianctl update --download-only` of v2 over
#                  HTTPS (v2 runs a new stand-in engine image: its bundle carries the engine
#                  partition image), then `applianctl update --apply`, and the power is cut as
#                  the new engine is being written to engine slot B
#   run 2  boot C  v1 again (the cut left it bootable, its engine untouched); the staged update
#                  is applied again, from /var, and succeeds: engine slot B, then /usr slot B
#          boot B  v2 (1.0.1) on trial, with its new engine: before it is judged, an update to v3
#                  is refused with both slots hashed before and after; then judged good and
#                  blessed; four bundles that must be refused (a flipped byte, an untrusted
#                  key, a kernel image signed by a Secure Boot key outside db, a downgrade)
#                  with the inactive slot hashed before and after; then
#                  `applianctl rollback`
#          boot R  v1 again, by the operator's rollback, with v1's engine from engine slot A;
#                  then `applianctl rollback --force` (v2 is out of tries since it was left)
#          boot F  v2 again, with its engine from slot B: the update to v3 (v2's engine: no
#                  engine written)
#          boot D  v3 (1.0.2), whose engine never becomes healthy: assessment fails, reboot (v2
#                  gives what it installs one try)
#          boot E  v2, booted by systemd-boot once v3's try ran out, with v2's engine; the
#                  final report
#
# A version's steps come from the credential appliance.plan (applianctl bootcheck); each runs
# once per disk, so the plan survives reboots and the power cut.

# `applianctl update` says "writing engine slot B: D12" as systemd-sysupdate's engine component
# starts writing the new engine into the free engine slot.
POWER_CUT_TEXT = "writing engine slot B:"
POWER_CUT_DELAY_S = 0.0
# podman's default network, where the engine's container has its address
CONTAINER_BRIDGE = "10.88.0.0/16"


@pytest.fixture(scope="session")
def https_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """A static HTTPS server (Debian's Caddy) over a directory of bundles: (root, url, CA PEM).
    QEMU's user network shows the host's loopback to the guest as 10.0.2.2."""
    work = tmp_path_factory.mktemp("bundles")
    tls.generate(work / "tls", "updates.appliance.test", [ipaddress.ip_address("10.0.2.2")], group="nonexistent-group")
    root = work / "www"
    root.mkdir()
    port = free_port()
    caddyfile = work / "Caddyfile"
    caddyfile.write_text(
        "{\n\tadmin off\n\tauto_https disable_redirects\n}\n"
        f"https://:{port} {{\n\ttls {work}/tls/server.crt {work}/tls/server.key\n"
        f"\troot * {root}\n\tfile_server\n}}\n"
    )
    proc = subprocess.Popen(["caddy", "run", "--config", str(caddyfile), "--adapter", "caddyfile"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"HOME": str(work), "XDG_DATA_HOME": str(work), "XDG_CONFIG_HOME": str(work),
                                 "PATH": "/usr/bin:/bin"})
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, "caddy exited: check the test's Caddyfile with `caddy validate`"
            time.sleep(0.1)
        else:
            raise AssertionError(f"caddy does not listen on {port}")
        yield root, f"https://10.0.2.2:{port}", (work / "tls/ca.crt").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


JOURNAL_REMOTE = "/usr/lib/systemd/systemd-journal-remote"


@pytest.fixture(scope="session")
def log_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real systemd-journal-remote (Debian's) over HTTPS on the host, for the journey's install
    plan ([logs]): the guest's systemd-journal-upload sends its journal here on every boot.
    {"url", "ca" (PEM), "dir" (the received journal files), "log"}."""
    work = tmp_path_factory.mktemp("collector")
    tls.generate(work / "tls", "logs.appliance.test", [ipaddress.ip_address("10.0.2.2")], group="nonexistent-group")
    (work / "journal").mkdir()
    port = free_port()
    log = work / "journal-remote.log"
    with log.open("wb") as out:
        # Debian 12's build has no GnuTLS client-certificate checking (--trust "is not available"):
        # the upload's own certificate is checked on the appliance's side (tests/test_tls.py)
        proc = subprocess.Popen([JOURNAL_REMOTE, f"--listen-https=127.0.0.1:{port}", f"--key={work}/tls/server.key",
                                 f"--cert={work}/tls/server.crt", "--split-mode=host", f"--output={work}/journal/"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, f"systemd-journal-remote exited: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        else:
            raise AssertionError(f"systemd-journal-remote does not listen on {port}")
        yield {"url": f"https://10.0.2.2:{port}", "ca": (work / "tls/ca.crt").read_text(), "dir": work / "journal", "log": log}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def with_new_engine(cfg: config.Config, work: Path) -> config.Config:
    """CFG with another stand-in engine image: the same code started through env(1), so its
    manifest digest differs (the builder builds the stand-in reproducibly and checks the pin)."""
    from builder import engine_image

    entrypoint = ("/usr/bin/env", "STANDIN_ENGINE_BUILD=2", *cfg.engine.entrypoint)
    digest = engine_image.build_standin_layout(work, entrypoint)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, entrypoint=entrypoint, digest=digest))


def never_serving(demo: config.Config) -> config.Config:
    """V3: an engine that stays "loading" for a day, and a short assessment deadline."""
    v3 = config.with_version(demo, V3)
    engine = dataclasses.replace(v3.engine, env={**v3.engine.env, "STANDIN_LOAD_SECONDS": "86400"})
    return dataclasses.replace(v3, engine=engine, update=dataclasses.replace(v3.update, assessment_deadline_s=60))


@pytest.fixture(scope="session")
def bundles(demo_config: config.Config, demo_image: Path, https_root: tuple[Path, str, str],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """v2 (a new engine image) and v3 (v2's engine) built and released on the HTTPS server, and
    the four bundles to refuse: the URLs by name."""
    root, url, _ = https_root
    key = build.signing_key_for(demo_config, None)
    v1_out = demo_image.parent
    v2 = with_new_engine(config.with_version(demo_config, V2), tmp_path_factory.mktemp("v2-engine"))
    # what v2 installs gets one boot try: v3 fails once and is rolled back (a sealed boot costs
    # 1.35x under TCG; boot counting's decrements are unit-tested, the tries after the first are not
    # worth two more emulated boots here)
    v2 = dataclasses.replace(v2, update=dataclasses.replace(v2.update, boot_tries=1))
    v3 = never_serving(v2)
    outputs = {}
    # v2's bundle is released for appliances that run v1's engine: it carries its own
    for name, cfg, previous, have in (("v2", v2, V1, demo_config.engine.digest), ("v3", v3, V2, v2.engine.digest)):
        outputs[name] = tmp_path_factory.mktemp(f"{name}-build") / "out"
        build.build(cfg, output=outputs[name])
        release.make_bundle(cfg, outputs[name], root / name, key, [have], previous_version=previous)
    # one flipped byte in a partition image; bundle.json (signed) still names the true hash
    shutil.copytree(root / "v3", root / "flipped", copy_function=os.link)
    verity = root / "flipped" / f"appliance_{V3}.usr-verity.raw"
    data = bytearray(verity.read_bytes())
    verity.unlink()
    data[len(data) // 2] ^= 0x01
    verity.write_bytes(bytes(data))
    # the same release, signed by a key the appliance does not trust
    stranger, _ = keys.generate(tmp_path_factory.mktemp("stranger-key"))
    release.make_bundle(v3, outputs["v3"], root / "untrusted", stranger, [v3.engine.digest], previous_version=V2)
    # the same release, whose kernel image is signed by a Secure Boot key the firmware's db lacks
    release.make_bundle(v3, foreign_signed(outputs["v3"], tmp_path_factory), root / "foreign-signed", key, [v3.engine.digest],
                        previous_version=V2)
    # a downgrade: v1's own build, released; with its install image, since the installer medium
    # (conftest.installed) carries only what the signed index lists
    release.make_bundle(demo_config, v1_out, root / "v1", key, [demo_config.engine.digest], with_install_image=True)
    channels = rollout_channels(root, key, tmp_path_factory.mktemp("channels"))
    return {**{name: f"{url}/{name}/" for name in ("v2", "v3", "flipped", "untrusted", "foreign-signed", "v1")},
            **{name: f"{url}/{name}/channel.json" for name in channels}}


def rollout_channels(root: Path, key: Path, work: Path) -> list[str]:
    """Two signed channel indexes of v3 (a phased rollout), each beside a copy of v3's bundle: in
    "channel-held" v3's rollout began as it was signed and takes 366 days to reach the whole fleet
    (the journey's appliance is admitted when its place, uniform over 0..1, is under the share: at
    boot time about 1/9000, so it stays out); "channel-reached" is the same index signed again,
    one sequence higher, whose rollout takes one second: the appliance is in it."""
    from appliance import rollout
    from appliance.signed import timestamp
    from builder import sign_channel

    now = time.time()
    for name, duration in (("channel-held", rollout.MAX_DURATION_S), ("channel-reached", 1)):
        out = root / name
        shutil.copytree(root / "v3", out / "v3", copy_function=os.link)
        if name == "channel-reached":  # the server's index, signed again: one sequence higher
            shutil.copy(root / "channel-held" / rollout.CHANNEL, out / rollout.CHANNEL)
        source = work / f"{name}.toml"
        source.write_text(f'channel = "journey"\n[[releases]]\nversion = "{V3}"\npath = "v3/"\n'
                          f'[releases.rollout]\nstart = "{timestamp.utc(now)}"\nduration_s = {duration}\n')
        sign_channel.make(source, out, key, now=now)
    return ["channel-held", "channel-reached"]



# The journey's host: the demo's disk size, the hostname and SSH key its signed install plan gives
# (they must survive every upgrade and rollback of the journey).
JOURNEY_HOSTNAME = "journey-07"
# builder.qemu's disk (-drive if=virtio, created after its fixed devices) is in PCI slot 5, as
# QEMU's `info pci` shows; the installer's USB controller gets a fixed address (like the probe
# NIC's 0x10) so that it does not move the disk, and the boot entry it makes stays valid
JOURNEY_DISK_PATH = "pci-0000:00:05.0"
INSTALLER_XHCI_ADDR = "0x11"
INSTALL_PLAN = f"""hostname = "{JOURNEY_HOSTNAME}"
[ssh]
authorized_keys = ["{{key}}"]
# the netprobe namespace's first address scrapes the metrics (netprobe.NOT_A_SCRAPER does not)
[metrics]
allowed_cidrs = ["198.51.100.1/32"]
# the host's systemd-journal-remote (conftest.log_collector)
[logs]
upload_url = "{{collector_url}}"
upload_ca = '''
{{collector_ca}}'''
[target]
by_path = "{JOURNEY_DISK_PATH}"
min_size_gib = {qemu.DISK_SIZE // (1 << 30) - 1}
max_size_gib = {qemu.DISK_SIZE // (1 << 30) + 1}
"""


def _openssh_line(public_pem: Path) -> str:
    from cryptography.hazmat.primitives import serialization

    pub = serialization.load_pem_public_key(public_pem.read_bytes())
    return pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + " journey@test"


@pytest.fixture(scope="session")
def installed(demo_config: config.Config, demo_image: Path, bundles: dict[str, str], https_root: tuple[Path, str, str],
              log_collector: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The journey starts from a blank disk: the installer (its kernel image built by the builder,
    on a USB medium made by `builder installer` with v1's bundle and a signed plan) writes it and
    makes the firmware boot entry the journey then boots through. The disk and the firmware
    variables are the journey guest's own (same QEMU devices, so the entry stays valid)."""
    from builder import installer_media, installer_uki, sign_plan

    work = tmp_path_factory.mktemp("journey")
    key = build.signing_key_for(demo_config, None)
    uki = installer_uki.build_uki(demo_config, output=work / "installer" / installer_uki.UKI_NAME)
    _, ssh_pub = keys.generate(work / "ssh")
    ssh_line = _openssh_line(ssh_pub)
    (work / "plan.toml").write_text(INSTALL_PLAN.format(key=ssh_line, collector_url=log_collector["url"],
                                                        collector_ca=log_collector["ca"].strip()))
    sign_plan.write(work / "plan.toml", key, work / "plan", demo_config)
    media = installer_media.make(demo_image.parent, demo_config.appliance.version, uki, work / "plan", work / "media", ["usb"],
                                 https_root[0] / "v1")
    disk, vars_fd = work / "disk.raw", work / "OVMF_VARS.fd"
    # the installer's output (its summary) straight to the second serial port as well as tty1
    dropin = "[Service]\nStandardOutput=file:/dev/ttyS1\nStandardError=file:/dev/ttyS1\n"
    started = time.monotonic()
    for attempt in range(1, INSTALL_ATTEMPTS + 1):
        with open(disk, "wb") as blank:
            blank.truncate(qemu.DISK_SIZE)
        qemu.firmware_vars(vars_fd, None)  # setup mode, as a new server's firmware: the installer enrolls
        shutil.rmtree(work / "tpm", ignore_errors=True)
        with qemu.Tpm(work / "tpm") as tpm:  # the journey guest's TPM (qemu.Guest keeps its state in DIR/tpm)
            cmd = [*qemu.qemu_command(disk, vars_fd, {"systemd.unit-dropin.appliance-installer.service": dropin}, tpm),
                   "-no-reboot", "-device", f"qemu-xhci,id=xhci,addr={INSTALLER_XHCI_ADDR}",
                   "-drive", f"if=none,id=medium,format=raw,readonly=on,file={media['usb']}",
                   "-device", "usb-storage,drive=medium,serial=MEDIUM-0001,bus=xhci.0",
                   "-serial", f"file:{work}/install-console.log", "-serial", f"file:{work}/install-output.log"]
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800, check=False)
        assert proc.returncode == 0, f"QEMU: {proc.stderr[-2000:]}"
        output = (work / "install-output.log").read_text(errors="replace") if (work / "install-output.log").exists() else ""
        console = (work / "install-console.log").read_text(errors="replace")
        table = json.loads(subprocess.run(["sfdisk", "-J", str(disk)], capture_output=True, text=True).stdout or "{}")
        if not _emulator_oops_before_install(console, output, table) or attempt == INSTALL_ATTEMPTS:
            break
        (work / "install-console.log").rename(work / f"install-console-{attempt}.log")
        (work / "install-output.log").unlink(missing_ok=True)
    return {"dir": work, "output": output, "console": console, "attempts": attempt,
            "seconds": round(time.monotonic() - started), "ssh_line": ssh_line, "table": table,
            "var_header": var_header(disk, table, work / "var-header-installed.img")}


def var_header(disk: Path, table: dict[str, Any], copy: Path) -> tuple[list[luks.Method], Path] | str:
    """The unlock methods of DISK's /var as the host reads them (a copy of the LUKS2 header and key
    slots, the partition's first 32 MiB: the host has no device-mapper, and needs none for this);
    what went wrong, for the test that asks, when it cannot be read."""
    try:
        return _var_header(disk, table, copy)
    except (subprocess.CalledProcessError, StopIteration, KeyError, OSError, UserError) as e:
        return f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"


def _var_header(disk: Path, table: dict[str, Any], copy: Path) -> tuple[list[luks.Method], Path]:
    part = next(p for p in table["partitiontable"]["partitions"] if p.get("name") == luks.VAR_LABEL)
    with open(disk, "rb") as src, open(copy, "wb") as dst:
        src.seek(int(part["start"]) * int(table["partitiontable"].get("sectorsize", 512)))
        dst.write(src.read(32 << 20))
    dump = subprocess.run(["cryptsetup", "luksDump", "--dump-json-metadata", str(copy)], capture_output=True, text=True, check=True)
    return luks.parse_header(dump.stdout), copy


def opens_with(header: Path, passphrase: str) -> bool:
    """Does PASSPHRASE open a key slot of the LUKS2 header copy HEADER (no device-mapper needed)?"""
    return subprocess.run(["cryptsetup", "open", "--test-passphrase", "--key-file=-", str(header)], input=passphrase,
                          capture_output=True, text=True).returncode == 0


# Under TCG on a loaded host the installer's kernel can oops in early boot, before any userspace:
# the int3 the kernel plants while it patches its own code (text poking) traps in sched_clock_cpu.
# It is an emulator fault, not the installer's, intermittent and not reproducible on demand. Such
# a run wrote nothing (the disk has no partition table), so it is run once more from scratch; any
# other failure is the installer's and is not retried.
INSTALL_ATTEMPTS = 2


def _emulator_oops_before_install(console: str, output: str, table: dict[str, Any]) -> bool:
    return (not re.search(r"Appliance \S+ (re-)?installed", output) and "partitiontable" not in table
            and oopsed_before_userspace(console))


@pytest.fixture(scope="session")
def journey_guest(demo_image: Path, installed: dict[str, Any]) -> qemu.Guest:
    # An installer that stopped before its summary (e.g. its kernel oopsed in early boot under TCG
    # on every attempt, see INSTALL_ATTEMPTS) leaves a blank disk; booting that would wait at the
    # firmware's shell until the journey's timeout, so every journey test errors now, with the
    # installer's console.
    if not re.search(r"Appliance \S+ (re-)?installed", installed["output"]):
        pytest.fail(f"the installer printed no summary; its console ends:\n{installed['console'][-3000:]}")
    return qemu.Guest(demo_image, installed["dir"])  # the installed disk and firmware variables, as they are


def _plan_credentials(bundles: dict[str, str], ca: str) -> dict[str, str]:
    plan = {
        V1: [{"do": "netprobe"}, {"do": "attest"}, {"do": "faults"}, {"do": "etc-dropin"}, {"do": "download-only", "url": bundles["v2"]},
             {"do": "apply"},
             # boot R: back on v1 by the operator's rollback, forward again to v2 (judged good, so --force)
             {"do": "rollback", "force": True}],
        V2: [
            # run by appliance-bootcheck-trial.service, before the assessment
            {"do": "update-on-trial", "url": bundles["v3"]},
            {"do": "refusals", "bundles": {n: bundles[u] for n, u in (("flipped", "flipped"), ("untrusted", "untrusted"),
                                                                       ("foreign-signed", "foreign-signed"),
                                                                       ("downgrade", "v1"))}},
            {"do": "attest"},  # the new release's PCR 11, proven from afar
            {"do": "rollback"},  # boot B: the operator goes back to v1 and its engine
            # a phased rollout of v3 that has not reached this appliance: nothing installed ...
            {"do": "rollout-hold", "url": bundles["channel-held"]},
            # ... and the same index signed again, the rollout over: v3 installed from it
            {"do": "update", "url": bundles["channel-reached"]},
        ],
    }
    return {"appliance.plan": json.dumps(plan), "appliance.update_ca": ca}


@pytest.fixture(scope="session")
def attestation(demo_config: config.Config, bundles: dict[str, str], https_root: tuple[Path, str, str],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fleet's verifier for the journey: its store (empty: boot A enrolls the appliance) and a
    signed channel index of the journey's releases."""
    work = tmp_path_factory.mktemp("attest")
    channel = attest_host.attest_channel(https_root[0], build.signing_key_for(demo_config, None), work)
    return {"store": work / "store", "channel": channel, "work": work}


def _attest_answerer(net: qemu.ProbeNet, attestation: dict[str, Path]) -> qemu.Answerer:
    return attest_host.answerer(net, attestation["store"], attestation["channel"], attestation["work"])


@pytest.fixture(scope="session")
def journey_run1(journey_guest: qemu.Guest, bundles: dict[str, str], https_root: tuple[Path, str, str],
                 attestation: dict[str, Path]) -> dict[str, Any]:
    """Boot A; the power is cut while it writes v2's engine into engine slot B. The guest has a
    second NIC on a network namespace of the host, routed to its container bridge, from which
    the host probes it and attests it."""
    creds = _plan_credentials(bundles, https_root[2])
    with qemu.ProbeNet(f"appliance-journey-{os.getpid()}", routes=(CONTAINER_BRIDGE,)) as net:
        return journey_guest.boot(timeout=3600, credentials=creds, cut_power=(POWER_CUT_TEXT, POWER_CUT_DELAY_S),
                                  answer={"netprobe": netprobe.answerer(net), "attest": _attest_answerer(net, attestation)},
                                  probe_net=net)


@pytest.fixture(scope="session")
def journey_run2(journey_guest: qemu.Guest, journey_run1: dict[str, Any], bundles: dict[str, str],
                 https_root: tuple[Path, str, str], attestation: dict[str, Path]) -> dict[str, Any]:
    """Boots C, B, R, F, D and E, on the same disk after the power cut; the probe network again,
    from which the host attests v2."""
    with qemu.ProbeNet(f"appliance-journey2-{os.getpid()}", routes=(CONTAINER_BRIDGE,)) as net:
        return journey_guest.boot(timeout=3600, credentials=_plan_credentials(bundles, https_root[2]),
                                  answer={"attest": _attest_answerer(net, attestation)}, probe_net=net)


@pytest.fixture(scope="session")
def first_boot(journey_run1: dict[str, Any]) -> dict[str, Any]:
    """The report of the demo image's first boot (systemd-repart runs, the engine starts), with
    the outcome of the engine fault scenarios run after that first look."""
    return reports_of(journey_run1)[0]


@pytest.fixture(scope="session")
def faults_boot(first_boot: dict[str, Any]) -> dict[str, Any]:
    return first_boot


def flip_byte_in_partition(disk: Path, partition_name: str, needle: bytes) -> int:
    """Flip one byte of NEEDLE inside the named GPT partition of DISK; return the disk offset."""
    import json
    import mmap
    import subprocess

    table = json.loads(subprocess.run(["sfdisk", "-J", str(disk)], capture_output=True, text=True, check=True).stdout)
    sector = table["partitiontable"].get("sectorsize", 512)
    (part,) = [p for p in table["partitiontable"]["partitions"] if p.get("name") == partition_name]
    start, size = part["start"] * sector, part["size"] * sector
    with open(disk, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        found = m.find(needle, start, start + size)
        assert found >= 0, f"{needle!r} not found in partition {partition_name}"
        m[found] ^= 0x01
        m.flush()
    return found


@pytest.fixture(scope="session")
def tampered_boot(demo_image: Path, demo_config: config.Config, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy of the demo image with one byte of the demo overlay flipped inside the /usr partition."""
    import subprocess

    work = tmp_path_factory.mktemp("tampered-boot")
    disk = work / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(demo_image), str(disk)], check=True)
    flip_byte_in_partition(disk, f"appliance_{demo_config.appliance.version}", b'VARIANT = "overlay-demo"')
    return qemu.Guest(disk, work, enroll_cert=build.secure_boot_certificate(demo_config)).boot(timeout=1500)
