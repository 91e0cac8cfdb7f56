# SPDX-License-Identifier: MIT
"""`make bench`, the image: rebuilding with no change against plain mkosi, preloading the engine
image against a plain copy, and the lean boot path (kernel image size, power-on to a healthy
engine) against mkosi's default initrd."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from appliance import config
from bench.common import Figure, elapsed, measured, size_label
from builder import build, engine_image, qemu
from builder.host_tools import mkosi_command
from testkit.standin import free_port

REBUILD_GOAL = PRELOAD_GOAL = 1.3  # ours / plain, at most
WARM_GOAL_S = 5.0  # a cache hit, under


def plain_mkosi(demo: config.Config, generated: Path, sandbox: Path, repart: Path, out: Path, key: Path) -> list[str]:
    """The baseline of a rebuild: plain mkosi with the options the builder gives it, on the tree it generated."""
    return [*mkosi_command(), *build.mkosi_arguments(demo, generated, sandbox, repart, out, key), "build"]


def bench_rebuild(demo: config.Config) -> list[Figure]:
    build.build(demo)  # warm caches so that both sides rebuild
    ours = elapsed(lambda: build.build(demo))
    key = build.signing_key_for(demo, None)
    generated, sandbox, repart = build.prepare(demo, None, key)
    out = Path(tempfile.mkdtemp(prefix="bench-mkosi-"))
    cmd = plain_mkosi(demo, generated, sandbox, repart, out, key)
    plain = elapsed(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    shutil.rmtree(out, ignore_errors=True)
    return [measured("rebuild, no change (builder vs plain mkosi)", ours, plain, "s", at_most=REBUILD_GOAL)]


def bench_preload(demo: config.Config, size: int = 2 * 1024**3) -> list[Figure]:
    work = Path(tempfile.mkdtemp(prefix="bench-engine-", dir="/var/tmp"))
    try:
        layout = work / "layout"
        layer = work / "layer"
        with open(layer, "wb") as f:
            for start in range(0, size, 64 * 1024**2):
                f.write(os.urandom(min(64 * 1024**2, size - start)))
        digest = engine_image.write_layout(layout, layer)
        pinned = dataclasses.replace(demo, engine=dataclasses.replace(demo.engine, digest=digest))
        cache = engine_image.CACHE / digest.replace(":", "-")
        shutil.rmtree(cache, ignore_errors=True)
        # the baseline copies into the cache's file system, and both sides wait for the disk
        plain_copy = engine_image.CACHE / f".bench-plain-copy-{os.getpid()}"
        shutil.rmtree(plain_copy, ignore_errors=True)

        def plain_copy_synced() -> None:
            shutil.copytree(layout, plain_copy)
            os.sync()

        def preload_synced() -> None:
            engine_image.obtain(pinned, layout)
            os.sync()

        plain = elapsed(plain_copy_synced)
        shutil.rmtree(plain_copy, ignore_errors=True)
        cold = elapsed(preload_synced)
        warm = elapsed(lambda: engine_image.obtain(pinned, layout))
        shutil.rmtree(cache, ignore_errors=True)
        gib = size_label(size)
        return [measured(f"preload {gib} engine image, cold (vs a plain copy)", cold, plain, "s", at_most=PRELOAD_GOAL),
                measured(f"preload {gib} engine image, warm (vs cold)", warm, cold, "s", under=WARM_GOAL_S, note="a cache hit")]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _proxy_health(port: int, hostname: str) -> bool:
    """One GET /health through the appliance's TLS proxy (forwarded by QEMU): the path clients
    take. The certificate is not checked: only the time matters here."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=hostname) as tls:
            tls.sendall(f"GET /health HTTP/1.1\r\nHost: {hostname}\r\nConnection: close\r\n\r\n".encode())
            return tls.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def boot_to_healthy(disk: Path, demo: config.Config, timeout: float = 1500, sealed: bool = True) -> float:
    """Seconds from starting QEMU (power-on: TCG, OVMF) on a copy of DISK until GET /health
    answers 200 through the proxy (forwarded from the host's loopback). The guest is killed
    then: only the time matters. SEALED: Secure Boot enforcing with the demo's certificate enrolled
    and a TPM, as every test boot; else the plain firmware (no SMM) and no TPM, its variable store
    still holding the certificate in db: the kernel checks /usr's root hash signature against it."""
    guest = qemu.Guest(disk, enroll_cert=build.secure_boot_certificate(demo))
    with contextlib.ExitStack() as stack:
        tpm = stack.enter_context(qemu.Tpm(guest.tpm_state)) if sealed else None
        return _time_to_healthy(guest, tpm, sealed, demo, timeout)


def boot_command(disk: Path, vars_fd: Path, tpm: qemu.Tpm | None, sealed: bool, port: int, demo: config.Config,
                 console: Path) -> list[str]:
    """QEMU for one timed boot: the proxy's HTTPS port forwarded from PORT on the host's loopback, the
    console into CONSOLE."""
    cmd = qemu.qemu_command(disk, vars_fd, {}, tpm, sealed=sealed, forwards=((port, demo.proxy.https_port),))
    return [*cmd, "-serial", f"file:{console}", "-serial", "null"]


def _time_to_healthy(guest: qemu.Guest, tpm: qemu.Tpm | None, sealed: bool, demo: config.Config, timeout: float) -> float:
    port = free_port()
    cmd = boot_command(guest.disk, guest.vars, tpm, sealed, port, demo, guest.dir / "console.log")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < timeout and proc.poll() is None:
            if _proxy_health(port, demo.proxy.hostname):
                seconds = time.monotonic() - started
                shutil.rmtree(guest.dir, ignore_errors=True)  # kept only when the boot failed
                return seconds
            time.sleep(1)
        raise RuntimeError(f"no healthy engine through the proxy within {timeout:.0f} s (console: {guest.dir / 'console.log'})")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# mkosi's default for the kernel modules initrd (every module, with every firmware file a module
# names): the baseline the lean boot path is measured against.
FULL_INITRD_ARGS = ("--kernel-modules-initrd-include=", "--kernel-modules-initrd-exclude=")


def without_weights(demo: config.Config) -> config.Config:
    """DEMO with no weights pinned: its first boot would wait for `make demo`'s mirror on the host,
    which a benchmark does not run (the engine never started: both boot figures unmeasured)."""
    return dataclasses.replace(demo, model=dataclasses.replace(demo.model, weights_manifest="", source=""))


def bench_boot(demo: config.Config) -> list[Figure]:
    """Kernel image size and power-on to healthy engine: the demo as built, against the same
    build with mkosi's default initrd modules. Builds twice and boots each once (~15 min)."""
    demo = without_weights(demo)
    work = Path(tempfile.mkdtemp(prefix="bench-boot-", dir="/var/tmp"))
    try:
        results = {}
        for label, extra in (("lean", ()), ("full", FULL_INITRD_ARGS)):
            result = build.build(demo, extra_mkosi_args=extra, output=work / label)
            uki = result.output_dir / f"appliance_{demo.appliance.version}.efi"
            results[label] = (uki.stat().st_size, boot_to_healthy(result.disk_image, demo))
            shutil.rmtree(result.output_dir, ignore_errors=True)  # 4 GB each
        (lean_size, lean_s), (full_size, full_s) = results["lean"], results["full"]
        return [measured("unified kernel image size (lean vs full initrd)", lean_size / 1e6, full_size / 1e6, "MB"),
                measured("power-on to healthy engine, TCG (lean vs full)", lean_s, full_s, "s",
                         note="one boot each; TCG varies by ~10%")]
    finally:
        shutil.rmtree(work, ignore_errors=True)


ROOT = Path(__file__).resolve().parents[1]


def unencrypted_var_tree(tree: Path) -> Path:
    """An extra tree that gives the demo image the plain ext4 /var of images before encrypted /var
    (no Encrypt= in its repart definition, no crypttab line, fstab and the verity unit by the
    partition's label): the unsealed baseline, which boots without a TPM."""
    extra = ROOT / "image/mkosi.extra"
    var = (extra / "usr/lib/repart.d/30-var.conf").read_text()
    (tree / "usr/lib/repart.d").mkdir(parents=True)
    (tree / "usr/lib/repart.d/30-var.conf").write_text("".join(line + "\n" for line in var.splitlines() if not line.startswith("Encrypt=")))
    (tree / "etc").mkdir()
    (tree / "etc/crypttab").write_text("# the bench's unsealed baseline: /var is not encrypted\n")
    (tree / "etc/fstab").write_text("PARTLABEL=appliance-var /var ext4 defaults,x-systemd.device-timeout=5min 0 2\n")
    unit = (ROOT / "units/appliance-var-verity.service").read_text()
    unit = unit.replace("dev-mapper-appliance\\x2dvar", "dev-disk-by\\x2dpartlabel-appliance\\x2dvar")
    unit = unit.replace("/dev/mapper/appliance-var", "/dev/disk/by-partlabel/appliance-var")
    (tree / "usr/lib/systemd/system").mkdir(parents=True)
    (tree / "usr/lib/systemd/system/appliance-var-verity.service").write_text(unit)
    return tree


SEALED_GOAL = 1.2  # sealed / unsealed, at most


def bench_sealed_boot(demo: config.Config) -> list[Figure]:
    """Power-on to a healthy engine through the proxy: sealed (Secure Boot enforcing, SMM, a TPM,
    /var in LUKS2 opened by the TPM) against the same image with a plain /var booted unsealed
    (plain firmware, no TPM). Two builds, two boots (~15 min)."""
    demo = without_weights(demo)
    work = Path(tempfile.mkdtemp(prefix="bench-sealed-", dir="/var/tmp"))
    try:
        plain = build.build(demo, extra_mkosi_args=(f"--extra-tree={unencrypted_var_tree(work / 'tree')}",),
                            output=work / "plain").disk_image
        unsealed = boot_to_healthy(plain, demo, sealed=False)
        shutil.rmtree(work / "plain", ignore_errors=True)
        sealed = boot_to_healthy(build.build(demo).disk_image, demo, sealed=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [measured("power-on to healthy engine, TCG (sealed vs unsealed)", sealed, unsealed, "s", at_most=SEALED_GOAL,
                     note="one boot each")]
