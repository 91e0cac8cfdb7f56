"""`make bench`: figures as ratios against baselines measured in the same run.

- rebuild with no change: the builder (checks, generation, mkosi) against plain mkosi given the
  same generated tree and options (target: at most 1.3x);
- preloading a generated engine image of 2 GiB (cold) against a plain copy of the same bytes
  (target: at most 1.3x), and again with the cache warm (target: under 5 s);
- `applianctl status`: median of 20 runs against the stand-in engine, healthy and hung;
- upgrades: the bytes a bundle ships when the engine digest is unchanged, against a full bundle
  whose engine partition image is a generated 2 GiB one (target: no engine bytes), and the time
  to write a /usr slot the appliance's way (blank the slot, then the image's own
  systemd-sysupdate with the shipped transfer definitions, on a loop device) against a plain
  copy of the same partition images (target: at most 1.3x);
- the lean boot path: the unified kernel image's size and the time from power-on (QEMU started,
  TCG) to a healthy engine (systemd reports the engine unit started, which is Notify=healthy),
  the demo image as built against the same image built with every module and firmware file in
  its initrd (mkosi's default, the "before");
- the weights: fetch against curl, the check before every start against sha256sum
  (builder/bench_weights.py);
- engine slots: the time to write the demo engine store into a free engine slot the way
  docs/disk-layout.md says an update will (blank the slot, then systemd-sysupdate's engine
  component) against `dd bs=4M conv=fsync` of the same bytes (target: at most 1.3x), slot A
  checked unchanged (builder/bench_engine.py); the sectors written to the running engine
  partition during an update are counted in the QEMU journey, where the partitions are real;
- a new engine's bytes in a bundle (what an appliance downloads) against its uncompressed
  partition image.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from appliance import bundle, config
from builder import build, engine_image, qemu, release
from builder.run import mkosi_command, run
from standin.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def _time(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def _row(name: str, ours: float, base: float, target: str) -> None:
    print(f"{name:<44} {ours:8.2f} s  baseline {base:8.2f} s  ratio {ours / base:5.2f}x  ({target})")


def bench_rebuild(demo: config.Config) -> None:
    build.build(demo)  # warm caches so that both sides rebuild
    ours = _time(lambda: build.build(demo))
    key = build.signing_key_for(demo, None)
    generated, sandbox, repart = build.prepare(demo, None, key)
    out = Path(tempfile.mkdtemp(prefix="bench-mkosi-"))
    args = build.mkosi_arguments(demo, generated, sandbox, repart, out, key)
    cmd = [*mkosi_command(), *args, "build"]
    plain = _time(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    shutil.rmtree(out, ignore_errors=True)
    _row("rebuild, no change (builder vs plain mkosi)", ours, plain, "target <= 1.3x")


def bench_preload(demo: config.Config, size: int = 2 * 1024**3) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-engine-", dir="/var/tmp"))
    try:
        layout = work / "layout"
        layer = work / "layer"
        with open(layer, "wb") as f:
            for _ in range(size // (64 * 1024**2)):
                f.write(os.urandom(64 * 1024**2))
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

        plain = _time(plain_copy_synced)
        shutil.rmtree(plain_copy, ignore_errors=True)
        cold = _time(preload_synced)
        warm = _time(lambda: engine_image.obtain(pinned, layout))
        _row("preload 2 GiB engine image, cold vs copy", cold, plain, "target <= 1.3x")
        print(f"{'preload 2 GiB engine image, warm (cache hit)':<44} {warm:8.2f} s  (target < 5 s)")
        shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_status(demo: config.Config) -> None:
    from standin.testing import StandinProcess

    env_base = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for label, faults in (("healthy engine", {}), ("hung engine", {"STANDIN_HANG_AFTER_S": "0"})):
        engine = StandinProcess(env=faults).wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = demo.to_json()
            cfg["engine"]["port"] = engine.port
            args = cfg["engine"]["args"]
            args[args.index("--port") + 1] = str(engine.port)  # the device's config model refuses a mismatch
            path = Path(tmp) / "appliance.json"
            path.write_text(json.dumps(cfg))
            env = {**env_base, "APPLIANCE_CONFIG": str(path), "APPLIANCE_RUN_DIR": tmp}
            times = []
            for _ in range(20):
                start = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "applianctl", "status", "--json"], env=env, capture_output=True)
                if r.returncode == 3:  # status could not run: its time says nothing
                    raise RuntimeError(f"applianctl status: {r.stderr.decode(errors='replace').strip()}")
                times.append(time.monotonic() - start)
            print(f"{'applianctl status, median of 20, ' + label:<44} {statistics.median(times):8.2f} s")
        engine.stop()


def bench_bundle_bytes(demo: config.Config, engine_bytes: int = 2 * 1024**3) -> None:
    out = build.output_dir(demo)
    key = build.signing_key_for(demo, None)
    work = Path(tempfile.mkdtemp(prefix="bench-bundle-", dir="/var/tmp"))
    try:
        # the last build, with its engine partition image replaced by 2 GiB of random bytes
        build_copy = work / "build"
        shutil.copytree(out, build_copy, copy_function=os.link)
        engine = build_copy / f"appliance_{demo.appliance.version}.engine.raw"  # as mkosi splits it out
        engine.unlink()
        with open(engine, "wb") as f:
            for _ in range(engine_bytes // (64 * 1024**2)):
                f.write(os.urandom(64 * 1024**2))
        full = release.make_bundle(demo, build_copy, work / "full", key)
        same_engine = release.make_bundle(demo, build_copy, work / "upgrade", key, [demo.engine.digest])
        total = {name: sum(f.size for f in index.files) for name, index in (("full", full), ("upgrade", same_engine))}
        shipped_engine = sum(f.size for f in same_engine.files if f.name.startswith("engine_"))
        print(f"{'bundle, engine digest unchanged':<44} {total['upgrade'] / 1e6:8.1f} MB  full bundle {total['full'] / 1e6:8.1f} MB"
              f"  ratio {total['upgrade'] / total['full']:5.2f}x  engine bytes shipped: {shipped_engine} (target: 0)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_new_engine_bytes(demo: config.Config) -> None:
    """What an appliance downloads for a new engine: the bundle's engine images (erofs, lz4hc
    inside; shipped without the slot's trailing zeros) against the partition images they fill."""
    work = Path(tempfile.mkdtemp(prefix="bench-engine-bytes-", dir="/var/tmp"))
    try:
        index = release.make_bundle(demo, build.output_dir(demo), work / "bundle", build.signing_key_for(demo, None))
        shipped = sum(f.size for f in index.files if f.name.startswith("engine_"))
        full = sum(size for name, size in index.partition_sizes.items() if name.startswith("engine_"))
        print(f"{'new engine: bytes downloaded vs partition':<44} {shipped / 1e6:8.2f} MB  partition images {full / 1e6:8.2f} MB"
              f"  ratio {shipped / full:6.3f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sh(*argv: str) -> str:
    return run(argv, capture=True).stdout


def image_root(usr: Path, root: Path, mounts: list[Path]) -> Path:
    """ROOT: a chroot of the built image's own /usr (its systemd-sysupdate, not the host's), with
    empty /src and /defs for a bundle's files and transfer definitions; each mount is added to
    MOUNTS for the caller to undo."""
    for d in ("usr", "etc", "dev", "proc", "sys", "run", "tmp", "var/tmp", "src", "defs"):
        (root / d).mkdir(parents=True)
    _sh("mount", "-o", "loop,ro", str(usr), str(root / "usr"))
    mounts.append(root / "usr")
    for d in ("bin", "sbin", "lib", "lib64"):
        (root / d).symlink_to(f"usr/{d}")
    shutil.copyfile(root / "usr/lib/os-release", root / "etc/os-release")
    _sh("mount", "--rbind", "/dev", str(root / "dev"))
    mounts.append(root / "dev")
    _sh("mount", "-t", "proc", "proc", str(root / "proc"))
    mounts.append(root / "proc")
    _sh("mount", "--rbind", "/sys", str(root / "sys"))
    mounts.append(root / "sys")
    return root


def undo(mounts: list[Path], loop: str, work: Path) -> None:
    """Unmount MOUNTS (last first), detach LOOP (if any), remove WORK: a bench's cleanup."""
    for m in reversed(mounts):
        subprocess.run(["umount", "-R", str(m)], check=False, capture_output=True)
    if loop:
        subprocess.run(["losetup", "-d", loop], check=False)
    shutil.rmtree(work, ignore_errors=True)


def bench_slot_write(demo: config.Config) -> None:
    """Write the last build's /usr and verity images into an empty slot on a loop device: plain
    dd of the partition images, then the appliance's way (blkdiscard --zeroout, then the image's
    own systemd-sysupdate in a chroot of its /usr, from the bundle's trimmed images)."""
    out = build.output_dir(demo)
    key = build.signing_key_for(demo, None)
    names = bundle.payload_names(demo.appliance.version, demo.engine.digest, with_engine=False)
    usr, verity = out / names["usr"], out / names["usr-verity"]
    work = Path(tempfile.mkdtemp(prefix="bench-slot-", dir="/var/tmp"))
    mounts: list[Path] = []
    loop = ""
    try:
        index = release.make_bundle(demo, out, work / "bundle", key, [demo.engine.digest])
        disk = work / "disk.img"
        mib = 1024**2
        size = usr.stat().st_size + verity.stat().st_size + 8 * mib
        with open(disk, "wb") as f:
            f.truncate(size)
        # slot A: a token older version (systemd-sysupdate wants two slots); slot B: empty, full size
        table = (f"label: gpt\nsize=2048, type={bundle.USR_TYPE}, name=appliance_0.0.1\n"
                 f"size=2048, type={bundle.USR_VERITY_TYPE}, name=appliance_0.0.1_verity\n"
                 f"size={usr.stat().st_size // 512}, type={bundle.USR_TYPE}, name=_empty\n"
                 f"size={verity.stat().st_size // 512}, type={bundle.USR_VERITY_TYPE}, name=_empty\n")
        subprocess.run(["sfdisk", "-q", str(disk)], input=table, text=True, check=True)
        loop = _sh("losetup", "-f", "--show", str(disk)).strip()
        # offsets on the loop device: build hosts in containers often get no partition nodes
        table_json = json.loads(_sh("sfdisk", "-J", loop))["partitiontable"]["partitions"]
        slot = [(int(p["start"]) * 512, int(p["size"]) * 512) for p in table_json[2:]]
        images = [usr, verity]

        def plain() -> None:
            for src, (start, _) in zip(images, slot, strict=True):
                _sh("dd", f"if={src}", f"of={loop}", "bs=4M", "oflag=seek_bytes", f"seek={start}", "conv=fsync,notrunc", "status=none")

        # a chroot of the image's own /usr, with the shipped transfer definitions aimed at the loop device
        root = image_root(usr, work / "root", mounts)
        for transfer in ("10-usr.transfer", "20-usr-verity.transfer"):
            text = (ROOT / "image/mkosi.extra/usr/lib/sysupdate.d" / transfer).read_text()
            text = text.replace("Path=auto", f"Path={loop}").replace("Path=/var/lib/appliance/update/source", "Path=/src")
            text = text.replace("ProtectVersion=%A", "")  # the chroot's os-release names the version it installs
            (root / "defs" / transfer).write_text(text)
        for staged, linked in bundle.source_names(index).items():
            if linked.endswith(".raw"):
                os.link(work / "bundle" / staged, root / "src" / linked)

        def ours() -> None:  # as applianctl.update.command.prepare_slot, then systemd-sysupdate
            for start, length in slot:
                _sh("blkdiscard", "--force", "--zeroout", "--offset", str(start), "--length", str(length), loop)
            for i in (3, 4):
                _sh("sfdisk", "-q", "--part-label", loop, str(i), "_empty")
            _sh("chroot", str(root), "/usr/lib/systemd/systemd-sysupdate", "--definitions=/defs", "--no-pager",
                "update", index.version)
            _sh("sync")

        base = _time(plain)
        mine = _time(ours)
        for src, (start, _) in zip(images, slot, strict=True):  # the slot holds exactly the signed bytes
            _sh("cmp", f"--ignore-initial=0:{start}", "-n", str(src.stat().st_size), str(src), loop)
        _row("write a /usr slot (blank + sysupdate vs dd)", mine, base, "target <= 1.3x")
    finally:
        undo(mounts, loop, work)


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


def boot_to_healthy(disk: Path, demo: config.Config, timeout: float = 1500) -> float:
    """Seconds from starting QEMU (power-on: TCG, OVMF) on a copy of DISK until GET /health
    answers 200 through the proxy (forwarded from the host's loopback). The guest is killed
    then: only the time matters."""
    guest = qemu.Guest(disk)
    port = free_port()
    cmd = qemu._qemu_command(guest.disk, guest.vars, {})
    nic = cmd.index("-nic") + 1
    cmd[nic] += f",hostfwd=tcp:127.0.0.1:{port}-:{demo.proxy.https_port}"
    cmd += ["-serial", f"file:{guest.dir / 'console.log'}", "-serial", "null"]
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
# names): what the demo's kernel image carried before the lean boot path.
FULL_INITRD_ARGS = ("--kernel-modules-initrd-include=", "--kernel-modules-initrd-exclude=")


def bench_boot(demo: config.Config) -> None:
    """Kernel image size and power-on to healthy engine: the demo as built, against the same
    build with mkosi's default initrd modules. Builds twice and boots each once (~15 min)."""
    work = Path(tempfile.mkdtemp(prefix="bench-boot-", dir="/var/tmp"))
    try:
        results = {}
        for label, extra in (("lean", ()), ("full", FULL_INITRD_ARGS)):
            result = build.build(demo, extra_mkosi_args=extra, output=work / label)
            uki = result.output_dir / f"appliance_{demo.appliance.version}.efi"
            results[label] = (uki.stat().st_size, boot_to_healthy(result.disk_image, demo))
            shutil.rmtree(result.output_dir, ignore_errors=True)  # 4 GB each
        (lean_size, lean_s), (full_size, full_s) = results["lean"], results["full"]
        print(f"{'unified kernel image size (lean vs full initrd)':<44} {lean_size / 1e6:8.1f} MB  baseline {full_size / 1e6:8.1f} MB"
              f"  ratio {lean_size / full_size:5.2f}x")
        _row("power-on to healthy engine, TCG (lean vs full)", lean_s, full_s, "one boot each; TCG varies by ~10%")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    demo = config.load(ROOT / "appliance.toml", "demo")
    from builder.bench_engine import bench_engine_slot_write  # issue 15
    from builder.bench_install import bench_install  # issue 13
    from builder.bench_weights import bench_weights_check, bench_weights_fetch  # issue 14

    benches = [bench_status, bench_preload, bench_bundle_bytes, bench_slot_write, bench_rebuild, bench_boot,
               bench_weights_fetch, bench_weights_check, bench_install, bench_engine_slot_write, bench_new_engine_bytes]
    only = os.environ.get("BENCH_ONLY")  # e.g. BENCH_ONLY=bench_boot make bench
    for bench in benches:
        if only and bench.__name__ not in only.split(","):
            continue
        try:
            bench(demo)
        except Exception as e:  # a benchmark that cannot run says so and the others still run
            print(f"{bench.__name__}: not measured: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
