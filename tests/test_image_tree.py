# SPDX-License-Identifier: MIT
"""The generated image tree (builder/render.py, no mkosi): a production tree carries no test
machinery, a demo tree carries the boot check; every unit's sandbox exposure is held to 3.0."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import config
from appliance.errors import UserError
from builder import engine_store, render

ROOT = Path(__file__).resolve().parents[1]

# What only test machinery does: act on a plan or a boot-check request passed in as a credential,
# or write to a serial port other than the console (ttyS1 is often the BMC's serial-over-LAN),
# or inject a fault (the synthetic bad versions' units); and the test package itself, testkit.
TEST_MACHINERY = re.compile(
    r"bootcheck|testkit|appliance\.plan|ttyS[1-9]|/dev/hvc|hvc[0-9]|ImportCredential=appliance|appliance\.demo\.fault|sysrq-trigger"
)


def _tree(profile: str, tmp_path: Path) -> Path:
    c = config.load(ROOT / "appliance.toml", profile)
    erofs, verity = tmp_path / "engine.erofs", tmp_path / "engine.verity"
    erofs.write_bytes(b"e")
    verity.write_bytes(b"v")
    store = engine_store.EngineStore(erofs, verity, "ab" * 32, engine_store.label_for(c.engine.digest))
    tree = tmp_path / profile
    with pytest.MonkeyPatch.context() as m:
        # Production's overlays are third-party files the operator supplies (not in the repository);
        # what they are does not matter here, only that they are installed where the units say.
        m.setattr(render, "install_engine_files", _placeholder_engine_files)
        render.generate_tree(c, tree, store)
    return tree


def _placeholder_engine_files(c: config.Config, tree: Path) -> None:
    for kind, files in (("overlays", c.engine.overlays), ("tuning", c.engine.tuning)):
        for pinned in files:
            target = tree / render.device_path(kind, pinned).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("# placeholder\n")


@pytest.fixture(scope="module")
def production_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree("production", tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="module")
def demo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree("demo", tmp_path_factory.mktemp("tree"))


def _machinery(tree: Path) -> dict[str, list[str]]:
    """Every file under TREE whose name or text matches TEST_MACHINERY, with what matched."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in tree.rglob("*") if p.is_file() or p.is_symlink()):
        if "__pycache__" in path.parts:
            continue
        name = str(path.relative_to(tree))
        hits = TEST_MACHINERY.findall(name)
        if path.is_file():
            hits += TEST_MACHINERY.findall(path.read_bytes().decode("utf-8", "replace"))
        if hits:
            found[name] = sorted(set(hits))
    return found


def test_production_tree_has_no_test_machinery(production_tree: Path) -> None:
    assert _machinery(production_tree) == {}


def test_production_tree_is_not_empty(production_tree: Path) -> None:
    # the scan above must have something to scan: applianctl, the units, the preset
    assert (production_tree / "usr/lib/python3/dist-packages/applianctl/__main__.py").is_file()
    assert (production_tree / "usr/lib/systemd/system/appliance-verify.service").is_file()
    preset = (production_tree / "usr/lib/systemd/system-preset/10-appliance.preset").read_text()
    assert "enable appliance-proxy.service" in preset
    assert not (production_tree / "usr/lib/python3/dist-packages/testkit").exists()


@pytest.mark.programs
def test_only_an_image_with_several_replicas_has_the_balancer(production_tree: Path, demo_tree: Path) -> None:
    """The unit is in both (ConditionPathExists= on the configuration keeps it out of a one-engine
    image), enabled by the preset, Debian's own haproxy.service disabled; the configuration only
    where the demo's two replicas need it, HAProxy's own parser accepting it."""
    for tree in (production_tree, demo_tree):
        unit = (tree / "usr/lib/systemd/system/appliance-balancer.service").read_text()
        assert "ConditionPathExists=/usr/lib/appliance/haproxy.cfg" in unit.splitlines()
        preset = (tree / "usr/lib/systemd/system-preset/10-appliance.preset").read_text().splitlines()
        assert "enable appliance-balancer.service" in preset and "disable haproxy.service" in preset
    assert not (production_tree / "usr/lib/appliance/haproxy.cfg").exists()
    cfg = demo_tree / "usr/lib/appliance/haproxy.cfg"
    assert "server replica1 127.0.0.1:8002 check" in cfg.read_text()
    if shutil.which("haproxy"):
        check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_demo_tree_has_the_boot_check(demo_tree: Path) -> None:
    found = _machinery(demo_tree)
    unit = "usr/lib/systemd/system/appliance-bootcheck.service"
    assert "ttyS1" in found[unit]
    assert "python3 -m testkit.bootcheck" in (demo_tree / unit).read_text()
    assert (demo_tree / "usr/lib/python3/dist-packages/testkit/bootcheck.py").is_file()
    assert "appliance.plan" in found["usr/lib/python3/dist-packages/testkit/boot_steps.py"]
    presets = "".join(p.read_text() for p in (demo_tree / "usr/lib/systemd/system-preset").iterdir())
    assert "enable appliance-bootcheck.service" in presets
    # Only testkit's guest half (the boot check, not the host's faults.py or standin.py), its units
    # and its preset are test machinery.
    assert {n.split("/")[-1] for n in found} <= {"appliance-bootcheck.service", "appliance-bootcheck-trial.service",
                                                "20-appliance-demo.preset", "bootcheck.py", "__init__.py",
                                                "boot_facts.py", "boot_report.py", "boot_steps.py",
                                                "engine_scenarios.py", "guest_commands.py", "hive.py", "hive_scenario.py",
                                                "appliance-demo-fault.service", "appliance-demo-panic.service",
                                                "appliance-demo-freeze.service", "appliance-demo-crash.service",
                                                "demo-source.conf"}
    # the demo's weights source comes with the boot; production's fetch imports no credential
    dropin = "usr/lib/systemd/system/appliance-model-fetch.service.d/demo-source.conf"
    assert "ImportCredential=appliance.model_source" in (demo_tree / dropin).read_text()


def test_the_boot_check_in_the_demo_tree_has_every_testkit_module_it_imports(demo_tree: Path) -> None:
    """The image cannot import from the host's checkout: every testkit module the shipped ones
    import (at the top or inside a function) is shipped beside them."""
    shipped = demo_tree / "usr/lib/python3/dist-packages/testkit"
    missing = []
    for path in sorted(shipped.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "testkit":
                names = [f"testkit.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            missing += [f"{path.name}: {n}" for n in names
                        if n.startswith("testkit.") and not (shipped / f"{n.split('.')[1]}.py").is_file()]
    assert (shipped / "bootcheck.py").is_file() and missing == []


def test_bootcheck_is_not_an_applianctl_verb() -> None:
    from applianctl.__main__ import COMMAND_MODULES

    assert "bootcheck" not in COMMAND_MODULES


@pytest.mark.parametrize("package", ["appliance", "applianctl", "builder", "installer", "standin"])
def test_the_product_never_imports_test_or_benchmark_machinery(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in {"testkit", "bench"}]
    assert offenders == []


# ------------------------------------------------------------------------- sandbox exposure
# Every service in either tree scores at most 3.0 in `systemd-analyze security --offline=true`.
# Exceptions, each with the reason its unit's comments give. The engine (a quadlet-generated
# unit, not in this tree) needs host IPC, devices and SYS_PTRACE for ROCm.
EXPOSURE_LIMIT = 3.0
EXCEPTIONS: dict[str, float] = {
    # mounts the engine's image store for podman: no mount namespace, CAP_SYS_ADMIN (see its comment)
    "appliance-engine-store.service": 3.9,
    # test-only (demo images): drives the updater, powers off, writes the report port
    "appliance-bootcheck.service": 9.6,
    "appliance-bootcheck-trial.service": 9.6,  # test-only, like the boot check: hashes both slots
}


def _exposure(unit: Path) -> float:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True).stdout
    found = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert found, out
    return float(found[0])


@pytest.mark.programs
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("profile", ["production", "demo"])
def test_every_service_within_exposure_limit(profile: str, production_tree: Path, demo_tree: Path) -> None:
    tree = production_tree if profile == "production" else demo_tree
    units = sorted((tree / "usr/lib/systemd/system").glob("*.service"))
    assert len(units) >= 8
    scores = {u.name: _exposure(u) for u in units}
    over = {n: s for n, s in scores.items() if s > EXCEPTIONS.get(n, EXPOSURE_LIMIT)}
    assert over == {}, scores


# ------------------------------------------------------------------------- boot robustness
def test_boot_deadline_counts_from_the_assessment_deadline(production_tree: Path, demo_tree: Path) -> None:
    for profile, tree in (("production", production_tree), ("demo", demo_tree)):
        c = config.load(ROOT / "appliance.toml", profile)
        timer = (tree / "usr/lib/systemd/system/appliance-boot-deadline.timer").read_text()
        assert f"OnBootSec={c.update.assessment_deadline_s + 300}s" in timer
        # only on counted boots (systemd-boot sets this variable for an entry with tries left)
        assert "ConditionPathExists=/sys/firmware/efi/efivars/LoaderBootCountPath-" in timer
        preset = (tree / "usr/lib/systemd/system-preset/10-appliance.preset").read_text()
        assert "enable appliance-boot-deadline.timer" in preset


def test_boot_menu_editor_off(production_tree: Path) -> None:
    assert "editor no" in (production_tree / "efi/loader/loader.conf").read_text().splitlines()


def _uki_profiles() -> dict[str, tuple[str, str]]:
    """image/mkosi.uki-profiles: each profile's ID -> (TITLE, Cmdline)."""
    profiles = {}
    for conf in sorted((ROOT / "image/mkosi.uki-profiles").glob("*.conf")):
        text = conf.read_text()
        fields = dict(re.findall(r"\b(ID|TITLE|Cmdline)=(.*)$", text, re.M))
        profiles[fields["ID"]] = (fields["TITLE"], fields["Cmdline"])
    return profiles


def test_the_boot_menu_factory_reset_entries_ask_what_their_titles_say() -> None:
    from applianctl import factory_reset

    profiles = _uki_profiles()
    assert set(profiles) == {"factory-reset", "factory-reset-keep-weights"}
    for title, cmdline in profiles.values():
        req = factory_reset.boot_request("usrhash=ab rw " + cmdline)
        assert req is not None and req.keep_settings
        assert req.keep_weights == ("weights" in title), (title, cmdline)


def test_the_default_boot_entry_is_a_main_profile_never_a_factory_reset(production_tree: Path) -> None:
    """systemd-boot picks the first entry its default pattern matches, in its own order: entries
    with no tries left last, the newest version first, and (257) a kernel image's profiles
    ("FILE.efi@ID") before its main entry. An upgrade's trial boot, a blessed boot and a fallback
    must each start a main entry."""
    import fnmatch

    from appliance.signed.bundle_index import DEFAULT_ENTRY

    lines = (production_tree / "efi/loader/loader.conf").read_text().splitlines()
    assert f"default {DEFAULT_ENTRY}" in lines
    profiles = list(_uki_profiles())

    def menu(*files: str) -> list[str]:
        return [f"{f}@{p}" for f in files for p in profiles] + list(files)  # per version: profiles first

    for files, booted in ((("appliance_2.0.0+3-0.efi", "appliance_1.0.0.efi"), "appliance_2.0.0+3-0.efi"),  # trial
                          (("appliance_2.0.0.efi", "appliance_1.0.0.efi"), "appliance_2.0.0.efi"),  # blessed
                          (("appliance_1.0.0.efi", "appliance_2.0.0+0-3.efi"), "appliance_1.0.0.efi")):  # v2 used up
        assert next(i for i in menu(*files) if fnmatch.fnmatchcase(i, DEFAULT_ENTRY)) == booted


def test_kernel_reboots_on_panic_and_arms_the_watchdog() -> None:
    mkosi_conf = (ROOT / "image/mkosi.conf").read_text()
    for word in ("panic=10", "oops=panic", "systemd.watchdog_sec=", "systemd.crash_action=reboot"):
        assert word in mkosi_conf, word


def test_lean_initrd_keeps_what_reaching_usr_needs() -> None:
    text = (ROOT / "image/mkosi.conf").read_text()
    assert "KernelModulesInitrdExclude=.*" in text
    include = text.split("KernelModulesInitrdInclude=")[1].split("Packages=")[0]
    patterns = [re.compile(line.strip()) for line in include.splitlines() if line.strip()]
    needed = ["drivers/block/virtio_blk.ko.xz", "drivers/nvme/host/nvme.ko.xz", "drivers/ata/ahci.ko.xz",
              "drivers/md/dm-verity.ko.xz", "fs/erofs/erofs.ko.xz", "fs/ext4/ext4.ko.xz", "fs/fat/vfat.ko.xz",
              "drivers/usb/storage/usb-storage.ko.xz", "drivers/watchdog/i6300esb.ko.xz",
              # ext4 and erofs ask for crc32c by alias only (mkosi follows no aliases): without them
              # neither root nor /usr mounts ("EXT4-fs: Cannot load crc32c driver", seen in QEMU)
              "crypto/crc32c_generic.ko.xz", "arch/x86/crypto/crc32c-intel.ko.xz", "lib/libcrc32c.ko.xz",
              # systemd-repart in the initrd formats /var through a loop device (without it: repart fails)
              "drivers/block/loop.ko.xz"]
    for path in needed:
        assert any(p.search(path) for p in patterns), path
    for path in ("drivers/gpu/drm/amd/amdgpu/amdgpu.ko.xz", "drivers/net/wireless/intel/iwlwifi/iwlwifi.ko.xz"):
        assert not any(p.search(path) for p in patterns), path


def test_bad_versions_use_words_the_demo_units_act_on(demo_tree: Path, production_tree: Path) -> None:
    from testkit import faults

    demo = config.load(ROOT / "appliance.toml", "demo")
    units = {p.name: p.read_text() for p in (demo_tree / "usr/lib/systemd/system").iterdir() if p.is_file()}
    for fault, words in faults.FAULTS.items():
        bad = faults.bad_version(demo, "9.9.9", fault, assessment_deadline_s=60)
        assert bad.config.appliance.version == "9.9.9" and bad.config.update.assessment_deadline_s == 60
        assert bad.mkosi_args == (f"--kernel-command-line={' '.join(words)}",)
        for word in words:
            if word.startswith("systemd.mask="):
                assert word.removeprefix("systemd.mask=") in units, word
            else:  # a demo unit acts on it, and no production unit does
                assert any(f"ConditionKernelCommandLine={word}" in text for text in units.values()), word
                assert not any(word in p.read_text() for p in (production_tree / "usr/lib/systemd/system").iterdir() if p.is_file())
    with pytest.raises(UserError, match="demo profile only"):
        faults.bad_version(config.load(ROOT / "appliance.toml", "production"), "9.9.9", "panic")
    with pytest.raises(UserError, match="unknown fault"):
        faults.bad_version(demo, "9.9.9", "gremlins")


def test_emergency_mode_reboots() -> None:
    """The initrd's and the system's emergency.service get a drop-in (a credential on the kernel
    command line) that reboots instead of waiting at a locked root account's prompt."""
    import base64

    from builder import build

    word = build.emergency_reboot_credential()
    name, _, encoded = word.removeprefix("systemd.set_credential_binary=").partition(":")
    assert name == "systemd.unit-dropin.emergency.service"
    dropin = base64.b64decode(encoded).decode()
    assert "SuccessAction=reboot-force" in dropin and "FailureAction=reboot-force" in dropin
    assert "ExecStart=\n" in dropin  # the shell is replaced, not added to
    assert " " not in word and len(word) < 512  # one word, and the kernel command line is short


def test_the_initrd_resets_etc_before_systemd_reads_it() -> None:
    """The initrd gets a unit (a credential) that puts the factory /etc of the signed /usr back,
    run in /sysroot after it and its /usr are mounted and before the initrd reads /sysroot/etc;
    the whole kernel command line stays well under the kernel's 2048 bytes."""
    import base64

    from builder import build

    words = build.initrd_credentials()
    assert "rd.systemd.wants=appliance-etc-reset.service" in words
    (unit_word,) = [w for w in words if "systemd.extra-unit.appliance-etc-reset.service:" in w]
    unit = base64.b64decode(unit_word.partition(":")[2]).decode()
    assert "ConditionPathExists=/etc/initrd-release" in unit  # inert after the switch to the real root
    assert "RootDirectory=/sysroot" in unit and "etc-reset --root /" in unit
    assert "After=sysroot.mount sysroot-usr.mount" in unit and "Before=initrd-parse-etc.service" in unit
    assert all(" " not in w for w in words)
    assert sum(len(w) + 1 for w in words) < 1500  # the built UKI's whole command line: about 1,750 bytes


def test_the_metrics_refresh_follows_the_configuration(production_tree: Path, demo_tree: Path) -> None:
    for profile, tree in (("production", production_tree), ("demo", demo_tree)):
        c = config.load(ROOT / "appliance.toml", profile)
        timer = (tree / "usr/lib/systemd/system/appliance-metrics.timer").read_text()
        assert f"OnUnitActiveSec={c.metrics.refresh_s}s" in timer
        unit = (tree / "usr/lib/systemd/system/appliance-metrics.service").read_text()
        assert "--output /run/appliance/metrics/appliance.prom" in unit
    # emulated, the demo refreshes far less often than a server (each refresh is one status run)
    demo, production = (config.load(ROOT / "appliance.toml", p).metrics.refresh_s for p in ("demo", "production"))
    assert demo > production


# applianctl's man page and bash completion, generated from its parser at build (appliance/cli_docs.py)
CLI_DOCS = (f"usr/share/man/man{render.APPLIANCTL_MAN_SECTION}/applianctl.{render.APPLIANCTL_MAN_SECTION}",
            "usr/share/bash-completion/completions/applianctl")


def _mkosi_list(key: str) -> list[str]:
    """The entries of KEY= in image/mkosi.conf (one per line, comments skipped)."""
    entries: list[str] = []
    inside = False
    for line in (ROOT / "image/mkosi.conf").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.startswith(f"{key}="):
            inside = True
            line = line.partition("=")[2]
        elif not line[:1].isspace():
            inside = False
        if inside and line.strip():
            entries.append(line.strip())
    return entries


@pytest.mark.parametrize("profile", ["production", "demo"])
def test_the_tree_ships_applianctl_man_page_and_completion(profile: str, production_tree: Path, demo_tree: Path) -> None:
    tree = production_tree if profile == "production" else demo_tree
    version = config.load(ROOT / "appliance.toml", profile).appliance.version
    page = (tree / CLI_DOCS[0]).read_text()
    assert f'.TH "APPLIANCTL" 8 "" "applianctl {version}"' in page
    assert '.SS "status"' in page and '.SS "model fetch"' in page and ".SH EXAMPLES" in page
    completion = (tree / CLI_DOCS[1]).read_text()
    assert completion.rstrip().endswith("complete -F _applianctl applianctl")
    assert "'model') echo 'fetch verify'" in completion or "model) echo 'fetch verify'" in completion


def test_the_image_keeps_the_appliances_man_pages_and_can_read_them(production_tree: Path, tmp_path: Path) -> None:
    """mkosi removes RemoveFiles= after it has copied the generated tree in: the patterns take
    Debian's man pages (and the alternatives' links to them), never the appliance's own."""
    root = tmp_path / "root"
    for name in CLI_DOCS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(production_tree / name, root / name)
    debian = root / "usr/share/man/man1/ls.1.gz"
    debian.parent.mkdir(parents=True)
    debian.write_bytes(b"")
    for pattern in _mkosi_list("RemoveFiles"):
        for path in root.glob(pattern.lstrip("/")):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    assert not debian.exists()
    assert all((root / name).is_file() for name in CLI_DOCS)
    packages = _mkosi_list("Packages")
    assert "man-db" in packages and "bash-completion" in packages  # `man applianctl`, and bash loads the completion


def test_the_progress_judge_runs_in_both_trees_and_the_engine_is_not_killed_on_health(production_tree: Path, demo_tree: Path) -> None:
    """appliance-judge.service runs `applianctl judge`, is enabled, restarts on failure under a
    watchdog; the engine's /health is readiness only (the judge is its liveness)."""
    for tree in (production_tree, demo_tree):
        unit = (tree / "usr/lib/systemd/system/appliance-judge.service").read_text().splitlines()
        assert "ExecStart=/usr/bin/applianctl judge" in unit and "Restart=on-failure" in unit
        assert "Type=notify" in unit and any(line.startswith("WatchdogSec=") for line in unit)
        assert "Before=appliance-proxy.service appliance-balancer.service" in unit
        preset = (tree / "usr/lib/systemd/system-preset/10-appliance.preset").read_text().splitlines()
        assert "enable appliance-judge.service" in preset
        quadlet = (tree / "usr/share/containers/systemd/appliance-engine@.container").read_text().splitlines()
        assert "HealthOnFailure=none" in quadlet and "HealthOnFailure=kill" not in quadlet
