# SPDX-License-Identifier: MIT
"""Each `make bench` figure's set-up, on a small input, so that a change elsewhere (the model
package, the installer, the release code, the rendered Caddyfile) cannot quietly leave a figure
unmeasured. Those that build an image or boot one (bench_rebuild, bench_boot, bench_sealed_boot)
and those that write a disk through a loop device and a chroot of a built image (bench_install,
bench_slot_write, bench_engine_slot_write) are checked up to the command lines they would run."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

import bench.__main__
from appliance import config
from bench.common import ROOT, Figure

DEMO = config.load(ROOT / "appliance.toml", "demo")
KIB = 1024


def _measured(figures: list[Figure], count: int) -> None:
    assert len(figures) == count and all(isinstance(f, Figure) for f in figures)
    assert all(f.baseline > 0 and f.ratio >= 0 and f.verdict in ("", "met", "NOT met") for f in figures)


def test_every_figure_has_a_test_here() -> None:
    text = Path(__file__).read_text()
    assert [b.__name__ for b in bench.__main__.BENCHES if f"def test_{b.__name__}" not in text] == []


# ------------------------------------------------------------------ run small, for real


@pytest.mark.programs
def test_bench_status(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.status import bench_status

    figures = bench_status(DEMO, runs=1)
    _measured(figures, 2)
    assert [f.name for f in figures] == ["applianctl status, median of 1, healthy engine (vs by hand)",
                                         "applianctl status, median of 1, hung engine (vs by hand)"]


def test_bench_preload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.image import bench_preload
    from builder import engine_image

    monkeypatch.setattr(engine_image, "CACHE", tmp_path / "cache")
    figures = bench_preload(DEMO, size=64 * KIB)
    _measured(figures, 2)
    assert figures[0].name == "preload 64 KiB engine image, cold (vs a plain copy)" and figures[1].goal == "under 5 s"
    assert list((tmp_path / "cache").iterdir()) == []  # the bench's image and its plain copy gone


def test_bench_bundle_bytes(tmp_path: Path) -> None:
    from fake_release import demo_config, fake_build, make_signing

    from bench.upgrade import bench_bundle_bytes

    key, _ = make_signing(tmp_path)
    demo = demo_config("1.0.0")
    built = fake_build(tmp_path / "out", demo, key)
    figures = bench_bundle_bytes(demo, engine_bytes=64 * KIB, out=built, key=key)
    _measured(figures, 2)
    shipped = figures[1]
    assert (shipped.ours, shipped.goal, shipped.verdict) == (0, "<= 0.00x", "met")  # the shared engine is not shipped again


def test_bench_new_engine_bytes(tmp_path: Path) -> None:
    from fake_release import demo_config, fake_build, make_signing

    from bench.upgrade import bench_new_engine_bytes

    key, _ = make_signing(tmp_path)
    demo = demo_config("1.0.0")
    _measured(bench_new_engine_bytes(demo, out=fake_build(tmp_path / "out", demo, key), key=key), 1)


@pytest.mark.programs
def test_bench_weights_check() -> None:
    from bench.weights import bench_weights_check

    figures = bench_weights_check(DEMO, sizes=(64 * KIB, 256 * KIB), file_bytes=64 * KIB)
    _measured(figures, 3)
    assert [f.name for f in figures] == ["start-time check, 64 KiB of weights (vs sha256sum)",
                                         "start-time check, 256 KiB of weights (vs sha256sum)",
                                         "start-time check, extrapolated to 156 GiB (vs sha256sum)"]


@pytest.mark.programs
def test_the_device_side_of_the_weights_check_refuses_changed_weights(tmp_path: Path) -> None:
    """The helper reads the check's result: weights it refuses are no figure."""
    from appliance.signed import weights_manifest
    from bench.weights import _device

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").write_bytes(b"x" * 100)
    one_file = weights_manifest.WeightFile("model.safetensors", 99, "0" * 64, "1" * 64)
    manifest = weights_manifest.make(DEMO.model.id, DEMO.model.revision, [one_file])
    (tmp_path / "weights.json").write_bytes(weights_manifest.dumps(manifest))
    with pytest.raises(RuntimeError, match=r"the device's weights check: .*has 100 bytes, the signed manifest 99"):
        _device("check", str(tmp_path / "weights.json"), str(snapshot))


@pytest.mark.programs
def test_bench_weights_fetch() -> None:
    if not shutil.which("caddy") or not shutil.which("curl"):
        pytest.skip("no caddy or curl (make setup installs them)")
    from bench.weights import bench_weights_fetch

    files = [("config.json", b"{}\n"), ("model.safetensors", os.urandom(256 * KIB))]
    figures = bench_weights_fetch(DEMO, runs=1, files=files)
    _measured(figures, 1)
    assert figures[0].goal == "<= 1.10x"


def _front_tools() -> None:
    pytest.importorskip("uvicorn")
    if not shutil.which("caddy"):
        pytest.skip("no caddy (make setup installs it)")


@pytest.mark.programs
def test_bench_proxy_stream() -> None:
    _front_tools()
    from bench.proxy import bench_proxy_stream

    _measured(bench_proxy_stream(DEMO, rounds=1, streams=2, each=1), 4)


@pytest.mark.programs
def test_bench_proxy_rps() -> None:
    _front_tools()
    from bench.proxy import bench_proxy_rps

    _measured(bench_proxy_rps(DEMO, rounds=1, clients=2, each=1), 1)


@pytest.mark.programs
def test_bench_replicas_rps() -> None:
    _front_tools()
    if not shutil.which("haproxy"):
        pytest.skip("no haproxy (make setup installs it)")
    from bench.replicas import bench_replicas_rps

    _measured(bench_replicas_rps(DEMO, rounds=1, clients=2, each=1), 1)


def test_the_judges_fake_systemd_restarts_a_replica_healthy(tmp_path: Path) -> None:
    """A restart by the judge clears that replica's faults and is a new start at once (the judge
    then judges it afresh); another replica's unit is left as it was."""
    from bench.judge import FakeSystemd

    lines: list[str] = []
    units = FakeSystemd(["appliance-engine@0.service", "appliance-engine@1.service"], {1: tmp_path / "faults-1.json"}, lines.append)
    (tmp_path / "faults-1.json").write_text('{"deadlock_after_s": 0}')
    before = units.states(units.names)
    units.restart("appliance-engine@1.service")
    after = units.states(units.names)
    assert (tmp_path / "faults-1.json").read_text() == "{}"
    assert after["appliance-engine@1.service"].active_since != before["appliance-engine@1.service"].active_since
    assert after["appliance-engine@0.service"] == before["appliance-engine@0.service"]
    assert {s.active for s in after.values()} == {"active"} and lines == ["fake systemd: restarted appliance-engine@1.service"]


@pytest.mark.programs
def test_bench_judge_removal() -> None:
    from bench.judge import BOUNDS, bench_judge_removal

    figures = bench_judge_removal(DEMO, trials=1, clients=2)
    _measured(figures, 1)
    (figure,) = figures
    assert figure.baseline == BOUNDS.stall_after_s and figure.goal == "<= 1.00x"
    assert 0.5 * BOUNDS.stall_after_s < figure.ours < 3 * BOUNDS.stall_after_s + 30  # the stall bound decided, not the wait


@pytest.mark.programs
def test_bench_judge_rps() -> None:
    _front_tools()
    if not shutil.which("haproxy"):
        pytest.skip("no haproxy (make setup installs it)")
    from bench.judge import bench_judge_rps

    figures = bench_judge_rps(DEMO, rounds=1, clients=(2, 2), each=(1, 1))
    _measured(figures, 2)
    assert [f.goal for f in figures] == [">= 0.98x", ">= 0.98x"]


@pytest.mark.programs
def test_bench_judge_canaries() -> None:
    from bench.judge import bench_judge_canaries

    idle, busy = bench_judge_canaries(DEMO, window_s=8, clients=2)
    _measured([idle, busy], 2)
    # moving counters send no canary; on a starved host a round can see a counter stand still once
    assert idle.ours > 0 and busy.ours <= idle.ours / 4 and busy.baseline == idle.ours


@pytest.mark.programs
def test_bench_metrics_scrape() -> None:
    from bench import metrics

    if not os.access(metrics.NODE_EXPORTER, os.X_OK) or not shutil.which("caddy"):
        pytest.skip("no node_exporter or caddy (make setup installs them)")
    figures = metrics.bench_metrics_scrape(DEMO, runs=1)
    _measured(figures, 1)
    assert figures[0].goal == "<= 1.50x and under 250 ms"


@pytest.mark.programs
def test_bench_flash_fleet() -> None:
    from bench.flash import bench_flash_fleet
    from testkit import bmc_rig

    if not bmc_rig.EMULATOR.exists():
        pytest.skip("sushy-tools is not installed (pip install -e '.[dev]')")
    figures = bench_flash_fleet(DEMO, hosts=2, install_s=0.5, rounds=1)
    _measured(figures, 2)
    assert figures[0].goal == "<= 1.50x" and figures[0].ours > 0.5 and figures[0].baseline > 0.5  # each waited for its install


def test_bench_flash_vs_direct_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two QEMU installs (make bench runs them); here only what stops it before the first: a host
    without libvirt, or no demo build."""
    from bench import flash
    from builder import build
    from testkit import libvirt_rig

    monkeypatch.setattr(libvirt_rig, "missing", lambda: ["libvirtd (libvirt-daemon-system)"])
    with pytest.raises(RuntimeError, match=r"this host lacks libvirtd \(libvirt-daemon-system\): run `make setup`"):
        flash.bench_flash_vs_direct(DEMO)
    monkeypatch.setattr(libvirt_rig, "missing", lambda: [])
    monkeypatch.setattr(build, "output_dir", lambda config: tmp_path / "none")
    with pytest.raises(FileNotFoundError, match=r"build the demo first"):
        flash.bench_flash_vs_direct(DEMO)


@pytest.mark.programs
def test_bench_attest() -> None:
    from bench import attest

    if not os.access(attest.NODE_EXPORTER, os.X_OK) or not shutil.which("caddy") or not shutil.which("swtpm"):
        pytest.skip("no node_exporter, caddy or swtpm (make setup installs them)")
    figures = attest.bench_attest(DEMO, runs=1, checks=3)
    _measured(figures, 2)
    assert [f.goal for f in figures] == ["under 1000 ms", "under 50 ms"]
    assert "(ok: release 1.0, Secure Boot enforcing)" in figures[0].note  # a proven verdict, the whole check


@pytest.mark.programs
def test_a_small_engine_store_for_the_engine_slot_figure(tmp_path: Path) -> None:
    if not shutil.which("mkfs.erofs") or not shutil.which("veritysetup"):
        pytest.skip("no mkfs.erofs or veritysetup (make setup installs them)")
    from bench.engine import generated_store

    erofs, verity = generated_store(tmp_path, 64 * KIB)
    assert erofs.stat().st_size >= 64 * KIB and verity.stat().st_size > 0


# ------------------------------------------------------------------ up to the heavy tool


def test_bench_install(tmp_path: Path) -> None:
    """The install figure's stand-ins and commands. A build host has no TPM: the installer's own
    definitions make /var with a key file (the image's say Encrypt=tpm2, which systemd-repart
    refuses without a TPM), the key file is handed into the chroot, the TPM2 enrollment is skipped
    and named, the firmware is left alone."""
    import bench.install
    from appliance.signed import bundle_index
    from builder import installer_uki
    from installer import install, secureboot

    defs = tmp_path / "defs"
    installer_uki.repart_definitions(DEMO, defs)
    var = (defs / "30-var.conf").read_text()
    assert "\nEncrypt=key-file\n" in var and "Encrypt=tpm2" not in var
    assert {"25-engine-b.conf", "26-engine-b-verity.conf"} <= {p.name for p in defs.iterdir()}  # + engine slot B

    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    runner = bench.install.LoopRunner(root, "/dev/loop7")
    key = tmp_path / "var.key"
    key.write_bytes(b"k" * 64)
    assert runner.command(["systemd-repart", "--dry-run=no", f"--definitions={install.REPART_DEFINITIONS}", f"--key-file={key}",
                           "/dev/loop7"]) == [
        "chroot", str(root), "systemd-repart", "--dry-run=no", "--definitions=/defs", "--key-file=/run/var.key", "/dev/loop7"]
    assert (root / "run/var.key").read_bytes() == key.read_bytes()
    tpm_enroll = ["systemd-cryptenroll", f"--unlock-key-file={key}", "--tpm2-device=auto", "--tpm2-pcrs=", "/dev/loop7p12"]
    recovery = ["systemd-cryptenroll", f"--unlock-key-file={key}", "--recovery-key", "--wipe-slot=password", "/dev/loop7p12"]
    assert runner.command(tpm_enroll) is None and runner.command(recovery) == recovery
    assert runner(tpm_enroll) == "" and runner(["udevadm", "settle"]) == "" and runner.skipped == ["systemd-cryptenroll", "udevadm"]
    runner(["efibootmgr", "--quiet", "--create", "--disk", "/dev/loop7", "--part", "1", "--label", "Appliance"])
    assert "Boot0001* Appliance" in runner(["efibootmgr"]) and runner.boot == {"0000": "debian", "0001": "Appliance"}

    sys_root, tpm, efivars = bench.install.host_stand_ins(tmp_path / "host")
    install.check_tpm(tpm)  # the TPM check passes
    assert secureboot.prepare(efivars)[0].action == "no-efi"  # no Secure Boot keys enrolled into this host's firmware
    assert not any(sys_root.iterdir())

    payload = install.Payload(image=tmp_path / "a.raw.zst", bmap=tmp_path / "a.bmap", version="1.0.0", usrhash="0" * 64,
                              engine_label="engine_x", engine_roothash="0" * 64,
                              image_file=bundle_index.BundleFile("a.raw.zst", "0" * 64, 1))
    hand = bench.install.by_hand_argv(payload, root, "/dev/loop7")
    assert hand[1] == ["chroot", str(root), "systemd-repart", "--dry-run=no", "--definitions=/defs", "--key-file=/run/var.key",
                       "/dev/loop7"]


def test_bench_slot_write() -> None:
    from appliance.signed import bundle_index
    from bench.common import sysupdate_argv
    from bench.upgrade import USR_TRANSFERS, usr_slot_table, usr_transfers

    table = usr_slot_table(3 << 30, 64 << 20)
    assert table.splitlines()[-2:] == [f"size={(3 << 30) // 512}, type={bundle_index.USR_TYPE}, name=_empty",
                                       f"size={(64 << 20) // 512}, type={bundle_index.USR_VERITY_TYPE}, name=_empty"]
    texts = usr_transfers("/dev/loop7")
    assert sorted(texts) == sorted(USR_TRANSFERS)
    for text in texts.values():
        paths = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("Path=")]
        assert paths == ["/src", "/dev/loop7"] and "ProtectVersion" not in text
    assert sysupdate_argv(Path("/r"), "1.0.1") == [
        "chroot", "/r", "/usr/lib/systemd/systemd-sysupdate", "--definitions=/defs", "--no-pager", "update", "1.0.1"]


def test_bench_engine_slot_write() -> None:
    from bench.engine import slot_table, transfers

    table = slot_table([64 << 20, 1 << 20]).splitlines()
    assert table[0] == "label: gpt" and [line.rsplit("name=", 1)[1] for line in table[1:]] == [
        "engine_000000000000", "engine_000000000000-verity", "_empty", "_empty"]
    texts, origin = transfers("/dev/loop7")
    assert origin in ("the image's", "docs/disk-layout.md's") and texts
    for text in texts.values():
        assert "Path=/dev/loop7" in text and "Path=/src" in text and "Path=auto" not in text


def test_bench_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import image
    from builder import build

    monkeypatch.setattr(build, "MKOSI_CACHE", tmp_path / "cache")
    monkeypatch.setattr(image, "mkosi_command", lambda: ["mkosi"])
    trees = (tmp_path / "generated", tmp_path / "sandbox", tmp_path / "repart", tmp_path / "out", tmp_path / "release.key")
    cmd = image.plain_mkosi(DEMO, *trees)
    assert cmd[0] == "mkosi" and cmd[-1] == "build"
    assert cmd[1:-1] == build.mkosi_arguments(DEMO, *trees)  # the options the builder gives mkosi


@pytest.mark.parametrize("sealed", [True, False])
def test_bench_boot(tmp_path: Path, sealed: bool) -> None:
    from bench import image

    cmd = image.boot_command(tmp_path / "disk.raw", tmp_path / "vars.fd", None, sealed, 4433, DEMO, tmp_path / "console.log")
    assert cmd[0] == "qemu-system-x86_64"
    assert f"hostfwd=tcp:127.0.0.1:4433-:{DEMO.proxy.https_port}" in cmd[cmd.index("-nic") + 1]
    assert cmd[-4:] == ["-serial", f"file:{tmp_path / 'console.log'}", "-serial", "null"]
    assert ("smm=on" in " ".join(cmd)) == sealed
    bare = image.without_weights(DEMO)
    assert (bare.model.weights_manifest, bare.model.source) == ("", "") and dataclasses.replace(bare, model=DEMO.model) == DEMO


def test_bench_sealed_boot(tmp_path: Path) -> None:
    from bench import image

    tree = image.unencrypted_var_tree(tmp_path / "tree")
    var = (tree / "usr/lib/repart.d/30-var.conf").read_text()
    assert "Encrypt=" not in var and "Format=ext4" in var
    assert "PARTLABEL=appliance-var /var ext4" in (tree / "etc/fstab").read_text()
    unit = (tree / "usr/lib/systemd/system/appliance-var-verity.service").read_text()
    assert "/dev/mapper/appliance-var" not in unit and "/dev/disk/by-partlabel/appliance-var" in unit
    assert image.SEALED_GOAL == 1.2
