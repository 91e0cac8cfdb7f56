"""The configuration-dependent tree that mkosi copies into the image (ExtraTrees).

appliance.json, the units and quadlet from units/*.j2, the engine partition and first-boot repart
definitions, applianctl, the engine's overlay and tuning files, OS settings and the weights manifest;
build.prepare adds the trusted key and the release plan.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jinja2

from appliance import paths
from appliance.bundle import EMPTY_LABEL as EMPTY
from appliance.bundle import ENGINE_TYPE, ENGINE_VERITY_TYPE
from appliance.caddyfile import render_caddyfile
from appliance.config import Config
from appliance.config.model import PinnedFile
from appliance.errors import UserError
from builder import unit_values, weights
from builder.engine_store import MOUNT_POINT, EngineStore, verity_slot_bytes

ROOT = Path(__file__).resolve().parents[1]
UNITS_DIR = ROOT / "units"
# Test machinery: the demo profile only, and only testkit's guest half (the rest runs on the test host).
TESTKIT_DIR = ROOT / "testkit"
TESTKIT_GUEST = ("__init__.py", "bootcheck.py")
LIB = Path("usr/lib/appliance")
SYSTEMD_DIR = Path("usr/lib/systemd/system")
QUADLET_DIR = Path("usr/share/containers/systemd")


@dataclass(frozen=True)
class Mount:
    """An overlay or tuning file as the engine unit mounts it: device path -> container path."""

    source: str
    target: str


def device_path(kind: str, pinned: PinnedFile) -> str:
    """Where a pinned engine file lives on the device (under the verity-protected /usr)."""
    return f"/{LIB}/engine/{kind}/{Path(pinned.file).name}"


def shm_size_mib(config: Config) -> int:
    return config.shm_size_mib


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(UNITS_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(unit_values.FILTERS)
    return env


def render_template(name: str, config: Config, store: EngineStore | None = None) -> str:
    context = {
        "config": config,
        "store": store,
        "store_mount_point": MOUNT_POINT,
        "overlays": [Mount(device_path("overlays", f), f.target) for f in config.engine.overlays],
        "tuning": [Mount(device_path("tuning", f), f.target) for f in config.engine.tuning],
        "shm_size_mib": shm_size_mib(config),
        # the demo profile runs emulated (QEMU under TCG), as the tests' own status calls scale it
        "status_timeout_scale": 20 if config.profile == "demo" else 1,
    }
    return _environment().get_template(name).render(context)


def _write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    path.chmod(mode)


def _rendered_name(template: Path) -> Path:
    name = template.name.removesuffix(".j2")
    if name.endswith(".container"):
        return QUADLET_DIR / name
    if name.endswith(".preset"):
        return Path("usr/lib/systemd/system-preset") / f"10-{name}"
    if name == "Caddyfile" or name.endswith(".nft"):
        return LIB / name
    return SYSTEMD_DIR / name


def render_units(config: Config, tree: Path, store: EngineStore) -> list[Path]:
    """Every unit in units/: templates rendered, static units copied."""
    written = []
    for source in sorted(UNITS_DIR.iterdir()):
        if source.name.startswith(".") or not source.is_file():
            continue
        if source.name == "Caddyfile.j2":
            text = render_caddyfile(config)  # checks every value
            # and the template: appliance-host.service renders it again with the plan's settings
            _write(tree / LIB / source.name, source.read_text())
            written.append(tree / LIB / source.name)
        elif source.suffix == ".j2":
            text = render_template(source.name, config, store)
        else:
            text = source.read_text()
        target = tree / _rendered_name(source)
        _write(target, text)
        written.append(target)
    return written


def install_applianctl(tree: Path) -> None:
    """applianctl as a command, run by the image's python3 (Debian's pydbus, requests, cryptography)."""
    for name in ("appliance", "applianctl"):
        package = tree / "usr/lib/python3/dist-packages" / name
        shutil.copytree(ROOT / name, package, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    _write(
        tree / "usr/bin/applianctl",
        "#!/usr/bin/python3\nimport sys\n\nfrom applianctl.__main__ import main\n\nsys.exit(main())\n",
        0o755,
    )


def install_demo(tree: Path) -> None:
    """The demo profile's test machinery (test images are demo images), never in production: the boot
    check (`python3 -m testkit.bootcheck`), testkit/units and their preset."""
    for name in TESTKIT_GUEST:
        _write(tree / "usr/lib/python3/dist-packages/testkit" / name, (TESTKIT_DIR / name).read_text())
    units = TESTKIT_DIR / "units"
    for source in sorted(p for p in units.rglob("*") if p.is_file()):
        directory = Path("usr/lib/systemd/system-preset") if source.suffix == ".preset" else SYSTEMD_DIR
        _write(tree / directory / source.relative_to(units), source.read_text())


def install_engine_files(config: Config, tree: Path) -> None:
    for kind, files in (("overlays", config.engine.overlays), ("tuning", config.engine.tuning)):
        for pinned in files:
            target = tree / device_path(kind, pinned).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / pinned.file, target)
            target.chmod(0o444)


def install_os_settings(config: Config, tree: Path) -> None:
    _write(tree / "etc/hostname", config.os.hostname + "\n")
    keys = "".join(key + "\n" for key in config.os.ssh_authorized_keys)
    _write(tree / LIB / "ssh/authorized_keys", keys)
    _write(
        tree / "etc/ssh/sshd_config.d/50-appliance.conf",
        "# Keys from appliance.toml and from the host's signed install plan (appliance-host.service); no passwords, ever.\n"
        f"AuthorizedKeysFile /{LIB}/ssh/authorized_keys /var/lib/appliance/host/authorized_keys\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n",
    )
    # No boot menu editor: without Secure Boot anyone at the console could set init=/bin/sh.
    _write(tree / "efi/loader/loader.conf", "# SPDX-License-Identifier: MIT\neditor no\n")
    # Engine logs bounded as the compose stack bounded them: log_max_size x log_max_files.
    size = int(config.engine.log_max_size[:-1]) * config.engine.log_max_files
    _write(
        tree / "usr/lib/systemd/journald.conf.d/50-appliance.conf",
        f"[Journal]\nStorage=persistent\nSystemMaxUse={size}{config.engine.log_max_size[-1].upper()}\n",
    )
    if config.profile == "demo":
        # The stand-in's "weights": the snapshot directory named by the engine's first argument.
        snapshot = config.model.weights_dir
        _write(
            tree / "usr/lib/tmpfiles.d/appliance-demo-model.conf",
            f"d {config.model.cache_dir} 0755 root root -\n"
            f"d {snapshot} 0755 root root -\n"
            f"f {snapshot}/config.json 0644 root root - {{}}\n"
            # the stand-in's fault switches, written by tests
            "d /run/appliance/standin 0755 root root -\n",
        )
    _write(
        tree / "usr/lib/tmpfiles.d/appliance.conf",
        f"d {config.model.cache_dir} 0755 root root -\n"
        f"d {config.engine.aiter_cache_dir} 0755 root root -\n"
        f"d {config.engine.crash_dir} 0700 root root -\n"
        "d /var/lib/appliance 0755 root root -\n"
        # per-host settings: upgrades never write /var, so they survive (docs/disk-layout.md)
        "d /var/lib/appliance/host 0700 root root -\n",
    )


ENGINE_PARTITION_DIR = Path("engine-partition")
# First-boot repart definitions (the installer's too): static ones in image/mkosi.extra, engine slots rendered.
FIRST_BOOT_REPART = Path("usr/lib/repart.d")


def _partition(comment: str, **keys: object) -> str:
    return f"# SPDX-License-Identifier: MIT\n# Generated by builder/render.py. {comment}\n[Partition]\n" + "".join(
        f"{key}={value}\n" for key, value in keys.items()
    )


def repart_definitions(store: EngineStore, directory: Path) -> None:
    """Engine slot A at build: the store's two partitions copied block for block, with the engine types
    and a full slot's size, so that first boot matches them to 15-engine-a*.conf and any later engine fits.
    Named 15-/16- to come before root, which stays last on the image and can grow."""
    if not store.slot_bytes:
        raise UserError(f"engine store {store.label}: not checked against engine.slot_size_gib",
                        hint="make the store with builder.engine_store.make(), which sizes it for a slot")
    verity = verity_slot_bytes(store.slot_bytes)
    for name, type_uuid, label, image, split, size in (
        ("15-engine-store.conf", ENGINE_TYPE, store.label, "engine.erofs", "engine", store.slot_bytes),
        ("16-engine-store-verity.conf", ENGINE_VERITY_TYPE, store.verity_label, "engine.verity", "engine-verity", verity),
    ):
        _write(directory / name, _partition(
            "Engine slot A: the engine image store, labelled by its digest (no ReadOnly=: repart ignores it for a type it does not know).",
            Type=type_uuid, Label=label, CopyBlocks=f"/{ENGINE_PARTITION_DIR}/{image}",
            SizeMinBytes=size, SizeMaxBytes=size, SplitName=split,
        ))


def first_boot_repart(config: Config, directory: Path) -> list[Path]:
    """Both engine slots for systemd-repart at first boot. Existing partitions match definitions of
    their type in file-name order, so slot A (made at build) takes 15-/16-; slot B is new, `_empty`, after
    /usr B (12-, 13-) and before /var (30-). Priority=1: a disk partitioned before engine slots existed
    drops them instead of failing every boot; it needs a re-install to gain slot B (docs/disk-layout.md)."""
    slot, verity = config.engine.slot_bytes, verity_slot_bytes(config.engine.slot_bytes)
    written = []
    for name, type_uuid, size, what in (
        ("15-engine-a.conf", ENGINE_TYPE, slot, "Engine slot A (made at build): matched, never resized."),
        ("16-engine-a-verity.conf", ENGINE_VERITY_TYPE, verity, "Engine slot A's hash tree (made at build)."),
        (paths.ENGINE_B_REPART[0], ENGINE_TYPE, slot, "Engine slot B: free until an update writes an engine to it."),
        (paths.ENGINE_B_REPART[1], ENGINE_VERITY_TYPE, verity, "Engine slot B's hash tree, sized for a full slot."),
    ):
        target = directory / name
        _write(target, _partition(what, Type=type_uuid, Label=EMPTY, SizeMinBytes=size, SizeMaxBytes=size, Priority=1))
        written.append(target)
    return written


def generate_tree(config: Config, tree: Path, store: EngineStore) -> None:
    tree.mkdir(parents=True)
    _write(tree / LIB / "appliance.json", json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n")
    render_units(config, tree, store)
    (tree / ENGINE_PARTITION_DIR).mkdir()
    for source, name in ((store.erofs, "engine.erofs"), (store.verity, "engine.verity")):
        shutil.copyfile(source, tree / ENGINE_PARTITION_DIR / name)
    first_boot_repart(config, tree / FIRST_BOOT_REPART)
    install_applianctl(tree)
    if config.profile == "demo":
        install_demo(tree)
    install_engine_files(config, tree)
    install_os_settings(config, tree)
    weights.install(config, tree)
