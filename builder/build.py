# SPDX-License-Identifier: MIT
"""Build the appliance image: check the pins, generate the tree, run mkosi, move the result into place.

mkosi writes to OUTPUT.tmp; only a successful build replaces the previous output.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.atomic import replace_dir
from appliance.config import Config
from appliance.errors import UserError
from appliance.run import checked
from appliance.signed import bundle_index
from builder import engine_image, engine_store, initrd_package, keys, mirror, pins, render, secureboot, tuning, weights
from builder.host_tools import HOST_CACHE, MISSING_HINT, mkosi_command

log = logging.getLogger("builder")

ROOT = render.ROOT
IMAGE_DIR = ROOT / "image"
MKOSI_CACHE = HOST_CACHE / "mkosi-cache"
# where the initrd puts /usr's root hash signature (image/initrd/package/usr/lib/appliance/usr-signature)
USR_SIGNATURE = "/run/appliance/usr-roothash.p7s"


@dataclass(frozen=True)
class BuildResult:
    output_dir: Path
    disk_image: Path
    version: str
    seconds: float


def work_dir(config: Config) -> Path:
    return ROOT / "build" / config.profile


def output_dir(config: Config) -> Path:
    return ROOT / "out" / config.profile


def write_sandbox(config: Config, sandbox: Path) -> None:
    """apt sources for mkosi and its tools tree: appliance.toml's os.mirror, else the host's."""
    mirrors = mirror.host_mirrors()
    if config.os.mirror:
        mirrors = mirror.Mirrors(config.os.mirror, config.os.security_mirror or None)
    if mirrors is None:
        raise UserError(
            "no Debian archive found in the host's apt configuration",
            hint="set os.mirror in appliance.toml to a Debian archive URL",
        )
    sources = sandbox / "etc/apt/sources.list.d/mkosi.sources"
    sources.parent.mkdir(parents=True, exist_ok=True)
    sources.write_text(mirror.sources_deb822(mirrors, config.os.release, ("main", "non-free-firmware")))


def emergency_reboot_credential() -> str:
    """The kernel command line word that adds image/initrd/emergency-reboot.conf to emergency.service
    (systemd.unit-dropin credential, systemd 256+); a credential because it must reach mkosi's initrd too."""
    lines = (IMAGE_DIR / "initrd/emergency-reboot.conf").read_text().splitlines()
    text = "".join(line + "\n" for line in lines if not line.startswith("#"))  # comments dropped: the kernel command line is short
    return f"systemd.set_credential_binary=systemd.unit-dropin.emergency.service:{base64.b64encode(text.encode()).decode()}"


# Runs in the initrd, before systemd reads the real /etc: the behaviour-changing places of
# /sysroot/etc become the factory /etc of the signed /usr again (appliance/factory_etc.py), so a
# drop-in or unit left in /etc lasts until the next boot at most, and an upgrade's /etc is its own.
# The initrd has no Python: it runs /usr's, in /sysroot (RootDirectory=). Not required: a reset that fails leaves
# whatever differs for `applianctl verify`, which refuses to start the engine over it.
ETC_RESET_UNIT = """[Unit]
Description=Reset /etc to the factory /etc of the signed /usr
DefaultDependencies=no
ConditionPathExists=/etc/initrd-release
ConditionPathExists=/sysroot/usr/share/factory/etc
Requires=sysroot.mount
After=sysroot.mount sysroot-usr.mount initrd-usr-fs.target
Before=initrd-parse-etc.service initrd-fs.target
[Service]
Type=oneshot
RootDirectory=/sysroot
ExecStart=/usr/bin/python3 -I -m applianctl etc-reset --root /
StandardOutput=journal+console
"""


# The first boot's /var (image/mkosi.extra/usr/lib/repart.d/30-var.conf: Encrypt=tpm2) sealed as
# applianctl/var/tpm_seal.py keeps it: PCR 7 and the kernel image's signed PCR 11 policy, whose public
# key systemd-stub puts in the initrd's /.extra (and tmpfiles copies to /run/systemd after it).
REPART_TPM2_DROPIN = """[Service]
ExecStart=
ExecStart=/usr/bin/bash -c 'k=/.extra/tpm2-pcr-public-key.pem; [ -e $$k ] || k=/run/systemd/tpm2-pcr-public-key.pem; \
exec systemd-repart --dry-run=no --tpm2-device=auto --tpm2-pcrs=7 --tpm2-public-key=$$k --tpm2-public-key-pcrs=11'
"""


def initrd_credentials() -> list[str]:
    """Kernel command line words that reach mkosi's initrd (and, inert there, the system after it):
    the emergency drop-in, the /etc reset unit and /var's TPM2 binding, as credentials (systemd 256+), and the wish for it."""
    def credential(name: str, text: str) -> str:
        return f"systemd.set_credential_binary={name}:{base64.b64encode(text.encode()).decode()}"

    return [emergency_reboot_credential(), credential("systemd.extra-unit.appliance-etc-reset.service", ETC_RESET_UNIT),
            credential("systemd.unit-dropin.systemd-repart.service", REPART_TPM2_DROPIN),
            "rd.systemd.wants=appliance-etc-reset.service"]


def mkosi_arguments(config: Config, generated: Path, sandbox: Path, repart: Path, out: Path, signing_key: Path) -> list[str]:
    """The options the builder adds to image/mkosi.conf (bench/image.py runs mkosi with the same)."""
    MKOSI_CACHE.mkdir(parents=True, exist_ok=True)
    return [
        # the project (for builder/finalize.py) and the signing key, mounted only while mkosi's scripts run
        f"--build-sources={ROOT}:appliance,{signing_key.parent}:signing-key",
        f"--environment=APPLIANCE_SIGNING_KEY_NAME={signing_key.name}",
        # for image/mkosi.postinst: the kernel image transfer's TriesLeft=
        f"--environment=APPLIANCE_BOOT_TRIES={config.update.boot_tries}",
        "-C", str(IMAGE_DIR),
        f"--extra-tree={generated}",
        f"--repart-directory={IMAGE_DIR / 'mkosi.repart'}",
        f"--repart-directory={repart}",
        f"--sandbox-tree={sandbox}",
        f"--tools-tree-sandbox-tree={sandbox}",
        f"--cache-directory={MKOSI_CACHE}",
        f"--output-directory={out}",
        f"--image-version={config.appliance.version}",
        *(f"--kernel-command-line={word}" for word in initrd_credentials()),
        f"--kernel-command-line=systemd.default_device_timeout_sec={config.os.device_timeout_sec}",
        # /usr's root hash signature (image/mkosi.repart/12-usr-verity-sig.conf, signed with the Secure
        # Boot key), which the initrd's package reads and dm-verity checks against the firmware's db
        f"--kernel-command-line=systemd.verity_usr_options=root-hash-signature={USR_SIGNATURE}",
        f"--package-directory={generated.parent / initrd_package.DIRECTORY}",
        f"--initrd-volatile-package={initrd_package.NAME}",
        f"--hostname={config.os.hostname}",
        *secureboot.mkosi_arguments(secureboot.boot_keys(config, signing_key)),
        *secureboot.verity_arguments(secureboot.boot_keys(config, signing_key)),
    ]


def signing_key_for(config: Config, given: Path | None) -> Path:
    """The release signing key: given, or keys/release.key; the demo makes one on the fly."""
    if given is not None:
        key = given
    elif config.profile == "demo":
        key = work_dir(config) / "keys" / "release.key"
        if not key.exists():
            keys.generate(key.parent)
    else:
        key = keys.DEFAULT_DIR / "release.key"
    if not key.is_file():
        raise UserError(f"no signing key at {key}", hint="make one with: python3 -m builder keys generate")
    return key.resolve()


def secure_boot_certificate(config: Config, signing_key: Path | None = None) -> Path:
    """The certificate CONFIG's images are signed with for Secure Boot (a firmware that enrolls it
    boots them, enforcing)."""
    return secureboot.boot_keys(config, signing_key_for(config, signing_key)).secure_boot_cert


def release_plan(config: Config, artifacts: list[pins.PinnedArtifact], store: engine_store.EngineStore) -> dict[str, object]:
    """The signed manifest's fields that finalize.py cannot read from the finished tree."""
    return {
        "version": config.appliance.version,
        "min_version": config.appliance.min_version,
        "profile": config.profile,
        "engine_image": {
            "reference": config.engine.reference,
            "digest": config.engine.digest,
            "store_label": store.label,
            "store_roothash": store.roothash,
        },
        "model": {"id": config.model.id, "revision": config.model.revision, **weights.release_pin(config)},
        "files": [{"kind": a.kind, "path": a.path, "sha256": a.sha256, "target": a.target} for a in artifacts],
        "gpu_required": config.gpu.required,
    }


def prepare(config: Config, engine_source: Path | None, signing_key: Path) -> tuple[Path, Path, Path]:
    """Check the inputs, generate the tree, repart definitions and sandbox; writes only under build/ and the host caches."""
    artifacts = pins.check(config, ROOT)  # before anything is written
    tuning.validate_all((a.path, ROOT / a.path) for a in artifacts if a.kind == "tuning")
    layout = engine_image.obtain(config, engine_source)
    store = engine_store.make(config, layout)
    work = work_dir(config)
    generated, sandbox, repart = work / "generated", work / "sandbox", work / "repart"
    for path in (generated, sandbox, repart):
        shutil.rmtree(path, ignore_errors=True)
    render.generate_tree(config, generated, store)
    render.repart_definitions(store, repart)
    initrd_package.make(work / initrd_package.DIRECTORY)
    public = signing_key.with_suffix(".pub")
    trusted = generated / render.LIB / "keys" / keys.trusted_name(public)
    trusted.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(public, trusted)
    # the timestamp key's public half, in a directory of its own: the release keys never vouch for freshness
    timestamp = keys.timestamp_key(signing_key.with_name(f"{keys.TIMESTAMP_NAME}.key"), make=config.profile == "demo").with_suffix(".pub")
    timestamp_trusted = generated / render.LIB / "timestamp-keys" / keys.trusted_name(timestamp)
    timestamp_trusted.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(timestamp, timestamp_trusted)
    # the key set a firmware in setup mode enrolls: on the ESP for systemd-boot's menu and the
    # installer, what it holds under /usr for status
    enroll = secureboot.enrollment_set(secureboot.boot_keys(config, signing_key), config.os.secure_boot_microsoft_ca,
                                       generated / secureboot.ESP_KEYS_DIR)
    (generated / render.LIB / "secureboot").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(enroll / "enroll.json", generated / render.LIB / "secureboot/enroll.json")
    (generated / render.LIB / "release-plan.json").write_text(json.dumps(release_plan(config, artifacts, store)))
    write_sandbox(config, sandbox)
    return generated, sandbox, repart


def check_package_manifest(output: Path, version: str) -> Path:
    """mkosi's package manifest of the image in OUTPUT (image/mkosi.conf: ManifestFormat=json), which
    every release publishes; UserError when mkosi wrote none or not one of VERSION."""
    path = output / bundle_index.mkosi_manifest_name(version)
    hint = "image/mkosi.conf's [Output] must say ManifestFormat=json; see mkosi's output above"
    if not path.is_file():
        raise UserError(f"mkosi wrote no package manifest at {path}", hint=hint)
    try:
        bundle_index.load_packages(path.read_bytes(), version)
    except ValueError as e:
        raise UserError(f"{path}: {e}", hint=hint) from None
    return path


def build(
    config: Config,
    extra_mkosi_args: tuple[str, ...] = (),
    engine_source: Path | None = None,
    signing_key: Path | None = None,
    output: Path | None = None,
) -> BuildResult:
    started = time.monotonic()
    key = signing_key_for(config, signing_key)
    generated, sandbox, repart = prepare(config, engine_source, key)
    final = (output or output_dir(config)).resolve()
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        checked(
            [*mkosi_command(), *mkosi_arguments(config, generated, sandbox, repart, staging, key), *extra_mkosi_args, "build"],
            what="mkosi build",
            hint="see mkosi's output above; run again with --debug for the full command",
            timeout=None, capture=False, missing_hint=MISSING_HINT,  # its output streams to the terminal
        )
        disk = staging / f"appliance_{config.appliance.version}.raw"
        if not disk.is_file():
            raise UserError(f"mkosi produced no disk image at {disk}", hint="see mkosi's output above")
        check_package_manifest(staging, config.appliance.version)  # published with every release
        # mkosi's tools tree lives in the output directory; keep it out of the result.
        shutil.rmtree(staging / "tools", ignore_errors=True)
        (staging / "build.json").write_text(
            json.dumps({"profile": config.profile, "version": config.appliance.version, "disk": disk.name}, indent=2)
            + "\n"
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, final)
    return BuildResult(final, final / disk.name, config.appliance.version, time.monotonic() - started)
