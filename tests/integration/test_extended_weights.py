# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended): the demo's weights fetched, resumed after a power
cut, refused when a mirror flips a byte, and refused at rest after a byte is flipped on the disk.

One demo image that pins the demo weights (weights/demo.json: about 128 MiB in 5 files, generated
by builder.weights.demo_files), plus a test-only unit in an extra tree that runs
tests/integration/weights_guest.py before the boot check (one stage per boot). The host serves the
weights over HTTPS (Python's ssl, the appliance CA tooling) and logs every range it serves; each
connection is throttled so that the power cut lands in the middle of the fetch under TCG.

    boot 1  engine not started (weights absent, the start check names a file); fetch; power cut
    boot 2  fetch resumes: each file in flight is asked for again at its journal's length, at
            most one 8 MiB chunk (model_fetch.CHUNK_BYTES) before what the server had sent;
            a mirror that flips a byte is refused naming the file; engine starts, status ok;
            the guest reports one file's first extent; at its end, a factory reset is asked for
            with --keep-weights (files planted where it must delete them)
    host    flips one byte of that file in the disk image (offline)
    boot 3  the reset ran first: planted files, the old journal, the scenario's own state gone; the
            weights, the TLS CA and the weights' verification kept; then the start check's digest
            still matches (it is of the signed contents), a plain read gets EIO, `model verify
            --deep` names the file; restarted, the engine stays stopped and status names the file
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from journey import reports_of

from appliance import config
from applianctl import tls
from builder import build, qemu, weights, weights_mirror
from builder.weights_mirror import Mirror

ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 8 << 20  # applianctl.model.fetch.CHUNK_BYTES (the guest's; asserted below)
IN_FLIGHT_SLACK = 4 << 20  # bytes the server sent that never reached the guest's disk (socket buffers, QEMU's network)
RATE = 2 << 20  # bytes per second per connection (the mirror's throttle): the fetch takes ~25 s, the cut lands inside it
CUT_AFTER_S = 8.0
FLIPPED_MIRROR = "model-00002-of-00003.safetensors"

pytestmark = [pytest.mark.integration, pytest.mark.extended]

UNIT = """# test-only (tests/integration/test_extended_weights.py): the weights scenario, before the boot check
[Unit]
Description=Test-only: the weights scenario
After=network-online.target appliance-model-verify.service appliance-engine@0.service appliance-engine@1.service
Wants=network-online.target
Before=appliance-bootcheck.service

[Service]
Type=oneshot
ImportCredential=appliance.*
Environment=APPLIANCE_PROGRESS_EVERY_S=1
ExecStart=/usr/bin/python3 /usr/lib/appliance-test/weights_guest.py
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=1h
"""


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, type[Mirror]]]:
    """The demo weights over HTTPS (tests/weights_mirror.py), throttled, BASE/flipped/ with a byte changed."""
    work = tmp_path_factory.mktemp("weights-mirror")
    weights.write_demo(work / "www")
    tls.generate(work / "tls", "weights.appliance.test", [ipaddress.ip_address("10.0.2.2")], group="nonexistent-group")
    with weights_mirror.serve(work / "www", work / "tls/server.crt", work / "tls/server.key", host="0.0.0.0",
                              flip=frozenset({FLIPPED_MIRROR}), rate=RATE) as (port, handler):
        # QEMU's user network shows the host's loopback to the guest as 10.0.2.2
        yield f"https://10.0.2.2:{port}/", (work / "tls/ca.crt").read_text(), handler


def _extra_tree(root: Path) -> Path:
    files = {
        "usr/lib/systemd/system/appliance-test-weights.service": UNIT,
        "usr/lib/appliance-test/weights_guest.py": (Path(__file__).parent / "weights_guest.py").read_text(),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    wants = root / "usr/lib/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "appliance-test-weights.service").symlink_to("../appliance-test-weights.service")
    return root


def _scenario(run: dict[str, Any], stage: str) -> dict[str, Any]:
    blocks = [r["weights_scenario"] for r in reports_of(run) if "weights_scenario" in r]
    found = [b for b in blocks if b["stage"] == stage]
    assert found, f"no {stage!r} report; got {[b['stage'] for b in blocks]}"
    return found[-1]


def _flip_on_disk(disk: Path, offset: int) -> None:
    with open(disk, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def weights_runs(demo_config: config.Config, mirror: tuple[str, str, type[Mirror]],
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from applianctl.model import fetch

    assert fetch.CHUNK_BYTES == CHUNK_BYTES
    url, ca, handler = mirror
    cfg = dataclasses.replace(demo_config, model=dataclasses.replace(demo_config.model, weights_manifest="weights/demo.json"))
    tree = _extra_tree(tmp_path_factory.mktemp("weights-tree") / "tree")
    disk = build.build(cfg, extra_mkosi_args=(f"--extra-tree={tree}",), output=tmp_path_factory.mktemp("weights") / "out").disk_image
    guest = qemu.Guest(disk, tmp_path_factory.mktemp("weights-guest"), enroll_cert=build.secure_boot_certificate(demo_config))
    # the scenario fetches by itself (no source for appliance-model-fetch.service)
    creds = {"appliance.weights_url": url, "appliance.weights_ca": ca, "appliance.wait": "120", qemu.MODEL_SOURCE: ""}
    runs: dict[str, Any] = {}
    runs["cut"] = guest.boot(timeout=1800, credentials=creds, cut_power=("WEIGHTS-FETCH-START", CUT_AFTER_S))
    runs["log_cut"] = [dict(e) for e in handler.log]
    runs["resume"] = guest.boot(timeout=2400, credentials=creds)
    runs["log_resume"] = [dict(e) for e in handler.log[len(runs["log_cut"]):]]
    resume = _scenario(runs["resume"], "resume")
    extent, var = resume["extent"], resume["var"]
    # a byte inside the file's first extent, past the first block: on the disk image, offline
    offset_in_file = 3 * 4096 + 123
    assert extent["logical"] == 0 and extent["length"] > offset_in_file, extent
    runs["flipped_at"] = var["start_bytes"] + extent["physical"] + offset_in_file
    _flip_on_disk(guest.disk, runs["flipped_at"])
    runs["at_rest"] = guest.boot(timeout=1800, credentials=creds)
    runs["console"] = guest.console_log.read_text(errors="replace")
    # boot 4: the boot menu's factory reset entry that keeps the weights, chosen at boot 3's end
    runs["menu_reset"] = guest.boot(timeout=1800, credentials=creds)
    runs["console_menu"] = guest.console_log.read_text(errors="replace")  # boot() starts each call's log afresh
    shutil.copyfile(guest.console_log, tmp_path_factory.mktemp("weights-console") / "console.log")
    return runs


def test_first_boot_keeps_the_engine_stopped_and_names_a_missing_file(weights_runs: dict[str, Any]) -> None:
    cut = _scenario(weights_runs["cut"], "cut")
    before = cut["before"]
    assert before["verify"]["exit"] == 1 and before["verify"]["result"]["file"] == "config.json", before
    assert before["engine"] != "active"
    assert before["status"]["state"] == "down" and before["status"]["file"] == "config.json", before["status"]
    assert weights_runs["cut"]["power_cut"], "the power was not cut during the fetch"


def test_the_fetch_resumes_refetching_at_most_one_chunk_per_file_in_flight(weights_runs: dict[str, Any]) -> None:
    resume = _scenario(weights_runs["resume"], "resume")
    assert resume["fetch"]["exit"] == 0, resume["fetch"]["stderr"]
    assert resume["verify"]["result"]["ok"], resume["verify"]
    sent: dict[str, int] = {}
    for e in weights_runs["log_cut"]:
        name = e["name"]
        sent[name] = max(sent.get(name, 0), e["start"] + e["sent"])
    in_flight = {name: n for name, n in sent.items() if name in resume["partials_after_cut"]}
    assert in_flight, f"no partial file after the cut: {resume['partials_after_cut']}"
    first_ranges = {}
    for e in weights_runs["log_resume"]:
        if not e["path"].startswith("/flipped/"):
            first_ranges.setdefault(e["name"], e["start"])
    for name, before_cut in in_flight.items():
        left = resume["partials_after_cut"][name]
        # a file the cut caught before its first chunk's journal was durable has none: from 0, which
        # refetches at most that chunk (seen: an empty .part, and a whole first chunk fsync'd with
        # the cut between its fsync and the journal's write)
        resumed_at = left["journal_length"] if left["journal_length"] is not None else 0
        assert left["journal_length"] is not None or left["size"] <= CHUNK_BYTES, (name, left)
        assert first_ranges[name] == resumed_at, (name, first_ranges[name], left)
        refetched = before_cut - first_ranges[name]
        assert refetched <= CHUNK_BYTES + IN_FLIGHT_SLACK, (name, refetched, left)


def test_a_byte_flipped_on_the_mirror_is_refused_naming_the_file(weights_runs: dict[str, Any]) -> None:
    resume = _scenario(weights_runs["resume"], "resume")
    flipped = resume["flipped_mirror"]
    assert flipped["exit"] == 1, flipped
    first = flipped["stderr"].strip().splitlines()
    assert any(line.startswith(f"applianctl: {FLIPPED_MIRROR}: SHA-256 ") and "is not the signed manifest's" in line
               for line in first), flipped["stderr"]
    assert resume["restored"]["exit"] == 0, resume["restored"]
    assert resume["status"]["state"] == "ok" and resume["status"]["verified"] is True, resume["status"]
    assert weights_runs["resume"]["engine_became_healthy"], weights_runs["resume"].get("status_text")


def test_a_byte_flipped_at_rest_is_refused_and_keeps_the_engine_stopped(weights_runs: dict[str, Any]) -> None:
    at_rest = _scenario(weights_runs["at_rest"], "at-rest")
    name = "model-00001-of-00003.safetensors"
    # the digest is of the signed contents: the constant-time check cannot see a changed block...
    assert at_rest["verify"]["result"]["ok"], at_rest["verify"]
    # ...but the kernel refuses it on any read, and the deep check names the file
    assert at_rest["plain_read"]["exit"] != 0 and "Input/output error" in at_rest["plain_read"]["stderr"], at_rest["plain_read"]
    deep = at_rest["deep"]
    assert deep["exit"] == 1 and deep["result"]["file"] == name, deep
    assert at_rest["engine"] != "active", at_rest["engine"]
    status = at_rest["status"]
    assert status["state"] == "down" and status["file"] == name and name in status["reason"], status


def test_read_throughput_sealed_against_unsealed(weights_runs: dict[str, Any]) -> None:
    """Reported, not held to the 1.15x goal for sealed reads here: under TCG the guest kernel's SHA-256 is emulated."""
    read = _scenario(weights_runs["resume"], "resume")["read"]
    ratio = read["sealed_s"] / read["unsealed_s"]
    print(f"sealed read {read['bytes'] / read['sealed_s'] / 2**20:.0f} MiB/s, unsealed {read['bytes'] / read['unsealed_s'] / 2**20:.0f} "
          f"MiB/s: {ratio:.2f}x (TCG)")
    assert read["sealed_s"] > 0 and read["unsealed_s"] > 0



def test_a_factory_reset_keeps_the_weights_and_settings_and_nothing_else(weights_runs: dict[str, Any]) -> None:
    asked = _scenario(weights_runs["resume"], "resume")["reset_asked"]
    refused = asked["refused"]
    assert refused["exit"] == 2 and "hint: run it again with --yes" in refused["stderr"], refused
    assert asked["asked"]["exit"] == 0 and "keeps the per-host settings" in asked["asked"]["stdout"], asked["asked"]
    # the boot menu's factory reset entries are profiles of each kernel image, listed by bootctl;
    # applianctl still sees one entry per version
    assert "Factory reset" in asked["bootctl"], asked["bootctl"][-2000:]
    slots_doc = json.loads(asked["slots"])
    versions = [e["version"] for e in slots_doc.get("entries", [])]
    assert len(versions) == len(set(versions)), slots_doc
    after = _scenario(weights_runs["at_rest"], "after-reset")
    record = after["record"]
    assert record is not None and record["by"] == "applianctl factory-reset", after
    assert any(k.endswith("/huggingface") for k in record["kept"]) and "/var/lib/appliance/tls" in record["kept"], record
    assert record["left"] == [] and record["deleted"] > 0, record
    assert after["request_left"] is False and after["planted_left"] == [], after
    assert "ActiveState=active" in after["unit"] and "Result=success" in after["unit"], after["unit"]
    # the journal of the boots before the reset went with it
    assert len(after["boots"].strip().splitlines()) == 1, after["boots"]
    assert len(asked["boots"].strip().splitlines()) >= 2, asked["boots"]
    assert after["ca"] is not None and after["ca"] == asked["ca"], "the TLS CA was not kept"
    # as a freshly installed appliance: the kept weights verify, the engine serves
    assert after["verify"]["result"]["ok"], after["verify"]
    assert after["engine"] == "active" and after["status"]["parts"]["weights"] == "ok", after["status"]
    assert after["status"]["state"] != "down", after["status"]
    # a new recovery key replaced the old one (the one made at first boot), shown on the console once
    seal = after["var_seal"]
    assert seal is not None and any("a new recovery key after the factory reset" in c for c in seal["changed"]), seal
    assert [m["kind"] for m in seal["methods"]].count("recovery") == 1, seal
    assert weights_runs["console"].count("/var recovery key (shown once") == 1, "the reset's boot shows its new key once"


def test_the_boot_menus_factory_reset_entry_resets_with_nobody_but_the_tpm(weights_runs: dict[str, Any]) -> None:
    """The entry an operator picks at the console when the appliance no longer boots far enough:
    its signed command line asks for the reset, the TPM opens /var for it (no recovery key typed),
    the weights are kept as its title says, and no new recovery key is shown."""
    asked = _scenario(weights_runs["at_rest"], "menu-asked")
    assert asked["set_oneshot"]["exit"] == 0, asked
    after = _scenario(weights_runs["menu_reset"], "after-menu-reset")
    assert "systemd.factory_reset=1" in after["cmdline"] and "appliance.factory_reset_keep_weights=1" in after["cmdline"], after
    assert len(after["selected"]) == 1 and after["selected"][0].endswith("@factory-reset-keep-weights"), after["selected"]
    record = after["record"]
    assert record is not None and record["by"] == "the kernel command line", after
    assert any(k.endswith("/huggingface") for k in record["kept"]) and record["left"] == [], record
    assert after["planted_left"] == [] and "Result=success" in after["unit"], after
    # the weights are kept as they were, with boot 3's flipped byte and its finding: still refused,
    # naming the file, so the engine stays stopped until `model fetch` puts the signed file back
    verified = after["verify"]
    assert verified["exit"] == 1 and "model-00001-of-00003.safetensors" in verified["stderr"] + verified["stdout"], verified
    assert after["engine"] != "active", after["engine"]
    assert "Please enter" not in weights_runs["console_menu"], "the console asked for /var's key"
    # whoever chose the entry at the console is not known to be the operator: the recovery key stays
    seal = after["var_seal"]
    assert seal is not None and not any("recovery key" in c for c in seal["changed"]), seal
    assert [m["kind"] for m in seal["methods"]].count("recovery") == 1, seal
    assert "/var recovery key (shown once" not in weights_runs["console_menu"], "a key was shown to the console"
    # whoever chose the entry sees what it did (appliance-factory-reset.service writes to the console too)
    assert "factory-reset: deleted" in weights_runs["console_menu"], weights_runs["console_menu"][-3000:]


def test_the_power_cut_counts_as_an_unclean_boot_for_the_crash_loop_guard(weights_runs: dict[str, Any]) -> None:
    """Boot 1 never served (no weights) and its power was cut: boot 2 counts one unclean boot of
    the version (judged good: the image's first boot is not counted by systemd-boot)."""
    count = _scenario(weights_runs["resume"], "resume")["crash_loop"]
    assert count is not None and count["unclean_in_a_row"] == 1 and count["clean"] is False, count
