# SPDX-License-Identifier: MIT
"""`make bench`, the weights:
- fetch: the demo's generated weights (about 128 MiB, 5 files) from a loopback Caddy over HTTPS
  with the device's fetcher against `curl --parallel` (target: at most 1.1x);
- the check before every start at 128 MiB and 1 GiB against `sha256sum`: it must stay flat while
  sha256sum grows (extrapolated to 156 GiB).

The build host's kernel has no fs-verity, so the device code (in its own interpreter, as on the
device) gets a stand-in: no sealing, and a measurement is an open and fstat. The rows say so; the
QEMU extended test measures the real ioctls.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance import config
from appliance import weights as wm
from bench.common import ROOT
from builder import weights
from testkit.standin import free_port

FULL_SIZE = 156 * 1024**3

# The device side, run as `python3 -c DEVICE MODE MANIFEST SNAPSHOT [URL CA]` in a fresh interpreter.
DEVICE = r"""
import json, os, sys, time
from pathlib import Path
from appliance import weights as wm
from applianctl.model import fetch as model_fetch
from applianctl.model import store as model_store
from applianctl.model import verify
mode, manifest_path, snapshot = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
manifest = wm.loads(manifest_path.read_bytes())
digests = {str(snapshot / f.path): f.fsverity for f in manifest.files}

class HostVerity:  # no fs-verity in the host's kernel: seal nothing, measure = open + fstat
    def enable(self, path, dir_fd=None):
        pass
    def measure(self, path, dir_fd=None):  # the full path given too: opened by it here
        fd = os.open(path, os.O_RDONLY)
        os.fstat(fd)
        os.close(fd)
        return digests.get(str(path)) or digests.get(str(snapshot / Path(path).name))

store = model_store.Store(manifest, snapshot, snapshot.parent / ".partial", snapshot.parent / "host")
start = time.monotonic()
if mode == "fetch":
    source = model_fetch.open_source(sys.argv[4], sys.argv[5], "plain", manifest.model, manifest.revision)
    model_fetch.fetch(store, source, HostVerity(), out=open(os.devnull, "w"))
else:
    result = verify.check(store, HostVerity())
    assert result["ok"], result
print(json.dumps({"elapsed_s": time.monotonic() - start}))
"""


def _device(*argv: str) -> tuple[float, float]:
    """The device code's own time, and the whole process's (interpreter start and imports included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", DEVICE, *argv], env=env, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.splitlines()[-1])["elapsed_s"]), time.monotonic() - start


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


def bench_weights_fetch(demo: config.Config, runs: int = 3) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-weights-", dir="/var/tmp"))
    try:
        www = work / "www"
        weights.write_demo(www)
        manifest = weights.demo_manifest(demo.model.id, demo.model.revision)
        (work / "weights.json").write_bytes(wm.dumps(manifest))
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
        print(f"{'weights fetch, 128 MiB over loopback HTTPS':<44} {a:8.2f} s  curl {b:8.2f} s  ratio {a / b:5.2f}x  "
              f"(target <= 1.1x; {mib / a:.0f} vs {mib / b:.0f} MiB/s; every byte hashed and fsync'd; whole process "
              f"{min(whole):.2f} s with interpreter start; host: sealing not measured)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_weights_check(demo: config.Config) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-check-", dir="/var/tmp"))
    try:
        rows = []
        for size in (128 * 1024**2, 1024**3):
            snapshot = work / str(size) / "snapshot"
            snapshot.mkdir(parents=True)
            files = []
            for i in range(size // (128 * 1024**2)):
                path = snapshot / f"model-{i:05d}.safetensors"
                with open(path, "wb") as f:
                    f.write(os.urandom(128 * 1024**2))
                files.append(wm.WeightFile(path.name, path.stat().st_size, "0" * 64, "1" * 64))
            (work / str(size) / "weights.json").write_bytes(wm.dumps(wm.make(demo.model.id, demo.model.revision, files)))
            subprocess.run(["sync"], check=True)
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)  # cold, as at boot
            start = time.monotonic()
            subprocess.run(["sha256sum", *sorted(str(p) for p in snapshot.iterdir())], check=True, stdout=subprocess.DEVNULL)
            sums = time.monotonic() - start
            check, process = _device("check", str(work / str(size) / "weights.json"), str(snapshot))
            rows.append((size, check, sums))
            print(f"{f'start-time check, {size / 1024**3:g} GiB of weights':<44} {check:8.3f} s  sha256sum {sums:8.2f} s  "
                  f"ratio {check / sums:5.3f}x  (whole process {process:.2f} s; host: measure = open + fstat, no fs-verity ioctl)")
        (small, _, sum_s), (big, check_b, sum_b) = rows
        per_byte = (sum_b - sum_s) / (big - small)
        print(f"{'  extrapolated to 156 GiB':<44} check ~{check_b:.3f} s (flat: per file, not per byte)  "
              f"sha256sum ~{sum_s + per_byte * (FULL_SIZE - small):.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    demo_config = config.load(ROOT / "appliance.toml", "demo")
    for bench in (bench_weights_fetch, bench_weights_check):
        bench(demo_config)
