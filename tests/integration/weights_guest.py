# SPDX-License-Identifier: MIT
"""Test-only, inside the guest (tests/integration/test_extended_weights.py puts it in an extra tree of
a demo image that pins the demo weights): the weights scenario, one stage per boot, driven by the
host through credentials, and reported as a JSON block on the second serial port (beside the boot
check's report, which follows it).

    boot 1  the engine did not start (weights absent); `applianctl model fetch` from the host's
            HTTPS server; the host cuts the power in the middle
    boot 2  what the cut left in .partial (each journal's length and the file's size), the fetch
            again (it resumes), verify; a mirror that flips a byte is refused naming the file,
            and the good one puts it back; the engine is started; the extents of one file are
            reported so the host can flip a byte of it on the disk image offline
            and a factory reset is asked for, keeping the weights (`--keep-weights --yes`), with files
            planted where it must delete them
    boot 3  the reset ran before anything used /var: the planted files, the old journal and this
            scenario's own state are gone, the weights, the TLS CA and the verification kept; then
            the constant-time check still passes (the digest is of the signed contents), a plain
            read gets EIO, `model verify --deep` names the file and records it; the engine
            restarted is refused by the start check and stays stopped; files planted again and the
            boot menu's "Factory reset ... and the weights" entry chosen for the next boot, as an
            operator at the console would (bootctl set-oneshot)
    boot 4  that entry's reset ran (its signed command line; the TPM opened /var for it): the
            planted files gone, the weights kept

Runs as root before the boot check (appliance-test-weights.service, After= the engine's start).
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STATE = Path("/var/lib/appliance-test/weights-stage")
BEGIN, END = "APPLIANCE-REPORT-BEGIN", "APPLIANCE-REPORT-END"
FLIP_FILE = "model-00001-of-00003.safetensors"
FS_IOC_FIEMAP = 0xC020660B


def credential(name: str) -> str:
    return (Path(os.environ["CREDENTIALS_DIRECTORY"]) / name).read_text().strip()


def run(*argv: str, timeout: float = 1800, whole: bool = False) -> dict[str, Any]:
    """ARGV's exit status and output (the last 4000 characters of each unless WHOLE)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"argv": list(argv), "exit": None, "stdout": "", "stderr": f"{type(e).__name__}: {e}"}
    sys.stdout.write(proc.stderr[-3000:])  # progress lines and errors on the console, for the host
    sys.stdout.flush()
    return {"argv": list(argv), "exit": proc.returncode, "stdout": proc.stdout if whole else proc.stdout[-4000:],
            "stderr": proc.stderr[-4000:]}


def verify(*extra: str) -> dict[str, Any]:
    out = run("/usr/bin/applianctl", "model", "verify", "--json", *extra)
    try:
        out["result"] = json.loads(out["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["result"] = None
    return out


def weights_status() -> Any:
    # the whole document: status --json is longer than run()'s usual tail
    out = run("/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20", timeout=120, whole=True)
    try:
        return json.loads(out["stdout"])["parts"].get("weights")
    except (ValueError, KeyError):
        return {**out, "stdout": out["stdout"][-4000:]}


def snapshot() -> Path:
    config = json.loads(Path("/usr/lib/appliance/appliance.json").read_text())
    return Path(config["model"]["weights_dir"])


def partials() -> dict[str, Any]:
    """What a cut left: each partial file's size and its journal's verified length."""
    config = json.loads(Path("/usr/lib/appliance/appliance.json").read_text())
    root = Path(config["model"]["cache_dir"]) / ".partial"
    out: dict[str, Any] = {}
    for part in sorted(root.rglob("*.part")):
        journal = part.with_name(part.name + ".journal")
        length = json.loads(journal.read_text())["length"] if journal.exists() else None
        out[part.name.removesuffix(".part")] = {"size": part.stat().st_size, "journal_length": length}
    return out


def fiemap_first_extent(path: Path) -> dict[str, int]:
    """The file's first extent (FIEMAP): logical and physical byte offsets and length."""
    header = struct.pack("=QQLLLL", 0, 2**64 - 1, 1, 0, 1, 0)  # start, length, FIEMAP_FLAG_SYNC, mapped, count=1, reserved
    buf = array.array("B", header + b"\0" * 56)
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf, True)
    logical, physical, length = struct.unpack_from("=QQQ", buf, 32)
    return {"logical": logical, "physical": physical, "length": length}


def var_partition_start() -> dict[str, Any]:
    """Where /var's file system starts on the disk: its partition's start, plus the LUKS2 data
    offset when /var is the dm-crypt device on top of it."""
    source = subprocess.run(["findmnt", "-no", "SOURCE", "/var"], capture_output=True, text=True, check=False).stdout.strip()
    name = Path(os.path.realpath(source)).name
    slaves = sorted(Path(f"/sys/class/block/{name}/slaves").glob("*"))
    offset = 0
    if slaves:
        status = subprocess.run(["cryptsetup", "status", Path(source).name], capture_output=True, text=True, check=False).stdout
        found = re.search(r"offset:\s+([0-9]+) sectors", status)
        if not found:
            raise RuntimeError(f"{source}: no data offset in `cryptsetup status`: {status[-300:]}")
        offset = int(found.group(1)) * 512
        name = slaves[0].name
    start = int(Path(f"/sys/class/block/{name}/start").read_text()) * 512 + offset
    return {"device": source, "start_bytes": start, "luks_offset": offset}


def read_seconds(path: Path) -> float:
    """Seconds to read PATH cold (page cache dropped first)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    start = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(4 << 20):
            pass
    return time.monotonic() - start


def sealed_vs_unsealed(target: Path) -> dict[str, float]:
    """Read throughput of a sealed weight file against an unsealed copy of it on the same /var."""
    copy = Path("/var/tmp/unsealed-copy")
    copy.write_bytes(target.read_bytes())
    try:
        return {"bytes": target.stat().st_size, "sealed_s": read_seconds(target), "unsealed_s": read_seconds(copy)}
    finally:
        copy.unlink()


def report(stage: str, data: dict[str, Any]) -> None:
    block = json.dumps({"weights_scenario": {"stage": stage, **data}})
    with open("/dev/ttyS1", "w") as port:
        port.write(f"{BEGIN}\n{block}\n{END}\n")


PLANTED = (Path("/var/lib/appliance/update/planted"), Path("/var/log/planted"), Path("/var/tmp/planted"))
LAST_RESET = Path("/var/lib/appliance/last-factory-reset.json")
TLS_CA = Path("/var/lib/appliance/tls/ca.crt")


def ask_factory_reset() -> dict[str, Any]:
    """Boot 2's end: files planted where a reset must delete them, the boot menu's entries, the
    command without --yes (refused) and with it; the next boot runs the reset."""
    for path in PLANTED:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("planted\n")
    out = {"refused": run("/usr/bin/applianctl", "factory-reset", "--keep-weights"),
           "bootctl": run("bootctl", "--no-pager", "list", "--json=short", whole=True)["stdout"][-16000:],
           "slots": run("/usr/bin/applianctl", "slots", "--json", whole=True)["stdout"][-8000:],
           "ca": TLS_CA.read_text() if TLS_CA.exists() else None,
           "boots": run("journalctl", "--list-boots", "-q", "--no-pager")["stdout"]}
    out["asked"] = run("/usr/bin/applianctl", "factory-reset", "--keep-weights", "--yes")
    os.sync()
    return out


VAR_SEAL = Path("/run/appliance/var-seal.json")
# the boot menu's entry that keeps the weights: a profile of the (only) kernel image, by pattern as
# systemd-boot matches entry ids (FILE.efi@PROFILE-ID, FILE with its boot counter if it has one)
MENU_RESET_ENTRY = "appliance_*.efi@factory-reset-keep-weights"
MENU_RESET_BY = "the kernel command line"  # applianctl/factory_reset.py boot_request()


def after_factory_reset() -> dict[str, Any]:
    quick = verify()
    return {"record": json.loads(LAST_RESET.read_text()) if LAST_RESET.exists() else None,
            "request_left": Path("/var/lib/appliance/factory-reset.json").exists(),
            "planted_left": [str(p) for p in PLANTED if p.exists()],
            "unit": run("systemctl", "show", "-p", "ActiveState", "-p", "Result", "appliance-factory-reset.service")["stdout"],
            "journal": run("journalctl", "-b", "-u", "appliance-factory-reset.service", "--no-pager", "-o", "cat")["stdout"],
            "boots": run("journalctl", "--list-boots", "-q", "--no-pager")["stdout"],
            "ca": TLS_CA.read_text() if TLS_CA.exists() else None,
            "verify": quick, "engine": run("systemctl", "is-active", "appliance-engine@0.service")["stdout"].strip(),
            "status": status_summary(),
            # /var's seal after the reset: a new recovery key, shown on the console (never in this record)
            "var_seal": json.loads(VAR_SEAL.read_text()) if VAR_SEAL.exists() else None}


def status_summary() -> Any:
    """The whole status' state and each part's (the document itself is too long for one report)."""
    out = run("/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20", timeout=120, whole=True)
    try:
        doc = json.loads(out["stdout"])
        return {"state": doc.get("state"), "parts": {k: v.get("state") for k, v in doc["parts"].items()}}
    except (ValueError, KeyError, AttributeError):
        return {**out, "stdout": out["stdout"][-4000:]}


def main() -> int:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    stage = STATE.read_text().strip() if STATE.exists() else "fresh"
    if stage == "fresh" and LAST_RESET.exists():
        # a reset deleted this scenario's own state too: boot 3 after the command's, boot 4 after the menu's
        stage = "menu-reset" if json.loads(LAST_RESET.read_text()).get("by") == MENU_RESET_BY else "flipped"
    url, ca = credential("appliance.weights_url"), Path("/run/appliance-test-ca.pem")
    ca.write_text(credential("appliance.weights_ca") + "\n")
    fetch = ("/usr/bin/applianctl", "model", "fetch", url, "--ca", str(ca), "--layout", "plain")
    if stage == "fresh":
        before = {"verify": verify(), "status": weights_status(),
                  "engine": run("systemctl", "is-active", "appliance-engine@0.service")["stdout"].strip()}
        STATE.write_text("fetching\n")
        os.sync()
        report("cut", {"before": before})
        print("WEIGHTS-FETCH-START", flush=True)  # the host cuts the power a few seconds after this line
        report("cut", {"before": before, "fetch": run(*fetch)})  # only if the host did not cut in time
        return 0
    if stage == "fetching":
        left = partials()
        resumed = run(*fetch)
        after = verify()
        flipped = run("rm", "-f", str(snapshot() / "model-00002-of-00003.safetensors"))
        flipped = run(*fetch[:3], url.rstrip("/") + "/flipped/", *fetch[4:])
        restored = run(*fetch)
        started = run("/usr/bin/applianctl", "start", "engine", timeout=900)  # every replica
        target = snapshot() / FLIP_FILE
        STATE.write_text("flipped\n")
        os.sync()
        resume = {"partials_after_cut": left, "fetch": resumed, "verify": after, "flipped_mirror": flipped,
                  "restored": restored, "engine_start": started, "status": weights_status(),
                  "extent": fiemap_first_extent(target), "var": var_partition_start(),
                  "filefrag": run("filefrag", "-v", str(target))["stdout"], "read": sealed_vs_unsealed(target)}
        boots = Path("/var/lib/appliance/update/boots.json")  # the crash-loop guard's count: boot 1 was cut
        resume["crash_loop"] = json.loads(boots.read_text()) if boots.exists() else None
        report("resume", {**resume, "reset_asked": ask_factory_reset()})
        return 0
    if stage == "flipped":
        target = snapshot() / FLIP_FILE
        # first, what a factory reset kept (the weights, unchanged on the disk but for the host's
        # flipped byte) and what it did not, as a freshly installed appliance is checked
        report("after-reset", after_factory_reset())
        quick = verify()
        plain_read = run("sh", "-c", f"cat {target} > /dev/null")
        deep = verify("--deep")
        restart = run("/usr/bin/applianctl", "restart", "engine", timeout=900)  # every replica
        time.sleep(5)
        report("at-rest", {"verify": quick, "plain_read": plain_read, "deep": deep, "engine_restart": restart,
                           "engine": run("systemctl", "is-active", "appliance-engine@0.service")["stdout"].strip(),
                           "status": weights_status()})
        for path in PLANTED:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("planted\n")
        chosen = run("bootctl", "set-oneshot", MENU_RESET_ENTRY)
        STATE.write_text("done\n")
        os.sync()
        report("menu-asked", {"set_oneshot": chosen})
        return 0
    if stage == "menu-reset":
        entries = json.loads(run("bootctl", "--no-pager", "list", "--json=short", whole=True)["stdout"] or "[]")
        report("after-menu-reset", {**after_factory_reset(), "cmdline": Path("/proc/cmdline").read_text(),
                                    "selected": [e.get("id") for e in entries if e.get("isSelected")]})
        STATE.write_text("done\n")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
