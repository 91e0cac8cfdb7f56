# SPDX-License-Identifier: MIT
"""`make bench`, the weights:
- fetch: the demo's generated weights (about 128 MiB, 5 files) from a loopback Caddy over HTTPS
  with the device's fetcher against `curl --parallel` (target: at most 1.1x);
- the check before every start at 128 MiB and 1 GiB against `sha256sum`: it must stay flat while
  sha256sum grows (extrapolated to 156 GiB).

The device code runs in its own interpreter, as on the device (bench/weights_device.py). The build
host's kernel has no fs-verity, so it gets a stand-in: no sealing, and a measurement is an open and
fstat. The rows say so; the QEMU extended test measures the real ioctls.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import builder.weights
from appliance import config, fsverity
from appliance.signed import weights_manifest
from bench.common import ROOT, Figure, measured, size_label
from testkit.standin import free_port

FULL_SIZE = 156 * 1024**3
FETCH_GOAL = 1.1  # the device's fetcher / curl, at most

def device_argv(*argv: str) -> list[str]:
    """The device's side (bench/weights_device.py) in a fresh interpreter."""
    return [sys.executable, "-m", "bench.weights_device", *argv]


def _device(*argv: str) -> tuple[float, float]:
    """The device code's own time, and the whole process's (interpreter start and imports included).
    A failure says the device's own last line (a CalledProcessError alone says nothing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run(device_argv(*argv), env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"the device's weights {argv[0]}: {last}")
    return float(json.loads(proc.stdout.splitlines()[-1])["elapsed_s"]), time.monotonic() - start


def _tls(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _caddy(root: Path, work: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    cert, key = _tls(work)
    port = free_port()
    (work / "Caddyfile").write_text(
        "{\n\tadmin off\n\tauto_https disable_redirects\n}\n"
        f"https://127.0.0.1:{port} {{\n\ttls {cert} {key}\n\troot * {root}\n\tfile_server\n}}\n"
    )
    proc = subprocess.Popen(["caddy", "run", "--config", str(work / "Caddyfile"), "--adapter", "caddyfile"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{port}/"
    for _ in range(100):
        if subprocess.run(["curl", "-sf", "--cacert", str(cert), "-o", "/dev/null", url + "config.json"]).returncode == 0:
            return proc, url, cert
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("caddy did not start")


def weights_files(directory: Path, files: Iterable[tuple[str, bytes]], model_id: str, revision: str) -> weights_manifest.WeightsManifest:
    """FILES written into DIRECTORY, and their manifest (SHA-256 and fs-verity digests, as builder weights makes it)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, data in files:
        (directory / name).write_bytes(data)
        entries.append(weights_manifest.WeightFile(name, len(data), hashlib.sha256(data).hexdigest(), fsverity.digest_bytes(data)))
    return weights_manifest.make(model_id, revision, entries)


def bench_weights_fetch(demo: config.Config, runs: int = 3, files: Iterable[tuple[str, bytes]] | None = None) -> list[Figure]:
    """FILES (by default the demo's weights, about 128 MiB) fetched RUNS times each way."""
    work = Path(tempfile.mkdtemp(prefix="bench-weights-", dir="/var/tmp"))
    try:
        www = work / "www"
        manifest = weights_files(www, builder.weights.demo_files() if files is None else files, demo.model.id, demo.model.revision)
        (work / "weights.json").write_bytes(weights_manifest.dumps(manifest))
        proc, url, ca = _caddy(www, work)
        try:
            ours, whole, curl = [], [], []
            for _ in range(runs):
                for d in ("dev", "curl"):
                    shutil.rmtree(work / d, ignore_errors=True)
                inner, process = _device("fetch", str(work / "weights.json"), str(work / "dev/snapshot"), url, str(ca))
                ours.append(inner)
                whole.append(process)
                (work / "curl").mkdir()
                argv = ["curl", "-sSf", "--no-progress-meter", "--parallel", "--parallel-max", "4", "--cacert", str(ca)]
                for f in manifest.files:
                    argv += ["-o", str(work / "curl" / f.path), url + f.path]
                start = time.monotonic()
                subprocess.run(argv, check=True)
                subprocess.run(["sync", "-f", str(work / "curl")], check=True)  # ours is on disk when it returns
                curl.append(time.monotonic() - start)
        finally:
            proc.kill()
            proc.wait()
        a, b = min(ours), min(curl)
        mib = manifest.total_bytes / 1024**2
        return [measured(f"weights fetch, {mib:.0f} MiB over loopback HTTPS (vs curl)", a, b, "s", at_most=FETCH_GOAL,
                         note=f"{mib / a:.0f} vs {mib / b:.0f} MiB/s; every byte hashed and fsync'd; whole process "
                              f"{min(whole):.2f} s with interpreter start; host: sealing not measured")]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_weights_check(demo: config.Config, sizes: tuple[int, int] = (128 * 1024**2, 1024**3),
                        file_bytes: int = 128 * 1024**2) -> list[Figure]:
    """The check at each of SIZES (files of FILE_BYTES each), and the larger extrapolated to 156 GiB."""
    work = Path(tempfile.mkdtemp(prefix="bench-check-", dir="/var/tmp"))
    try:
        rows = []
        figures = []
        for size in sizes:
            snapshot = work / str(size) / "snapshot"
            snapshot.mkdir(parents=True)
            files = []
            for i in range(size // file_bytes):
                path = snapshot / f"model-{i:05d}.safetensors"
                with open(path, "wb") as f:
                    f.write(os.urandom(file_bytes))
                files.append(weights_manifest.WeightFile(path.name, path.stat().st_size, "0" * 64, "1" * 64))
            pinned = weights_manifest.make(demo.model.id, demo.model.revision, files)
            (work / str(size) / "weights.json").write_bytes(weights_manifest.dumps(pinned))
            subprocess.run(["sync"], check=True)
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)  # cold, as at boot
            start = time.monotonic()
            subprocess.run(["sha256sum", *sorted(str(p) for p in snapshot.iterdir())], check=True, stdout=subprocess.DEVNULL)
            sums = time.monotonic() - start
            check, process = _device("check", str(work / str(size) / "weights.json"), str(snapshot))
            rows.append((size, check, sums))
            figures.append(measured(f"start-time check, {size_label(size)} of weights (vs sha256sum)", check, sums, "s",
                                    note=f"whole process {process:.2f} s; host: measure = open + fstat, no fs-verity ioctl"))
        (small, _, sum_s), (big, check_b, sum_b) = rows
        per_byte = max(sum_b - sum_s, 0.0) / (big - small)
        figures.append(measured("start-time check, extrapolated to 156 GiB (vs sha256sum)", check_b,
                                sum_s + per_byte * (FULL_SIZE - small), "s", note="flat: per file, not per byte"))
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    demo_config = config.load(ROOT / "appliance.toml", "demo")
    for bench in (bench_weights_fetch, bench_weights_check):
        bench(demo_config)
