"""`applianctl status` end to end: the real stand-in engine (python3 -m standin serve), systemd
mocked on a private bus, recorded GPU output, and a temporary tree for every file it reads."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import mmap
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from mock_systemd import MockSystemd, start_mock_systemd, stop_mock_systemd
from standin_engine import MODEL, free_port, start_standin, stop

from appliance import config as builder_config
from appliance import paths
from applianctl import probes, status

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"
ROCM_SMI_TEXT = (FIXTURES / "gpu" / "rocm-smi-concise-and-showmeminfo-vram-mi300x-x8-spx-rocm633.txt").read_text()


# ----------------------------------------------------------------------------------- helpers


def gpu_runner(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """amd-smi is not installed; rocm-smi prints the recorded MI300X output."""
    if argv[0] == "rocm-smi":
        return 0, ROCM_SMI_TEXT
    if argv[0] == "findmnt":
        return 1, ""
    raise probes.ToolMissing(argv[0])


def make_ca(path: Path, days: float) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "appliance test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def systemd_mock() -> Iterator[MockSystemd]:
    proc, mock = start_mock_systemd()
    for unit in paths.UNITS:
        mock.add(unit, restarts=0, result="success")
    try:
        yield mock
    finally:
        stop_mock_systemd(proc)


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    proc = start_standin(port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def hung_engine() -> Iterator[str]:
    port = free_port()
    proc = start_standin(port, STANDIN_HANG_AFTER_S="0")
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    """The demo profile's real appliance.json, with the model cache in the temporary tree."""
    data = builder_config.load(ROOT / "appliance.toml", "demo").to_json()
    (tmp_path / "hf").mkdir()
    data["model"]["cache_dir"] = str(tmp_path / "hf")
    return data


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> Path:
    run, state, shm = tmp_path / "run", tmp_path / "state", tmp_path / "shm"
    for d in (run, state, shm):
        d.mkdir()
    for name, value in {
        "STARTUP_REPORT": run / "startup-report.json",
        "SHM_CHECK": run / "shm-check.json",
        "VERIFY_RESULT": run / "verify.json",
        "PREFLIGHT_RESULT": run / "preflight.json",
        "STATE_DIR": state,
        "TLS_DIR": state / "tls",
        "SHM_DIR": shm,
    }.items():
        monkeypatch.setattr(paths, name, value)
    (tmp_path / "os-release").write_text(f"ID=debian\nIMAGE_VERSION={config['appliance']['version']}\n")
    return tmp_path


def sources(tree: Path, engine_url: str, mock: MockSystemd | None = None, **kw: Any) -> probes.Sources:
    (tree / "proc").mkdir(exist_ok=True)
    return probes.Sources(
        engine_url=engine_url,
        cmdline=tree / "cmdline",
        os_release=tree / "os-release",
        by_partuuid=tree / "by-partuuid",
        by_partlabel=tree / "by-partlabel",
        sys_class_block=tree / "sys-class-block",
        efivars=tree / "efivars",
        proc=tree / "proc",
        run=gpu_runner,
        bus=mock.bus if mock else None,
        **kw,
    )


def write_healthy(tree: Path, config: dict[str, Any]) -> None:
    expected = config["expected"]
    (paths.STARTUP_REPORT).write_text(
        json.dumps({"state": "ok", "reason": "", "figures": {**expected, "cuda_graphs": "FULL", "ready": True}})
    )
    paths.VERIFY_RESULT.write_text(json.dumps({"ok": True, "reason": "", "version": "1.0.0", "signer": "release-2026"}))
    paths.PREFLIGHT_RESULT.write_text(json.dumps({"ok": True, "reason": ""}))
    paths.SHM_CHECK.write_text(json.dumps({"ok": True, "reason": ""}))
    make_ca(paths.TLS_DIR / "ca.crt", days=3650)


# ----------------------------------------------------------------------------------- whole command


def test_healthy_appliance_is_ok_within_300_ms(
    tree: Path, config: dict[str, Any], engine: str, systemd_mock: MockSystemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_healthy(tree, config)
    src = sources(tree, engine, systemd_mock)
    status.collect(config, src)  # warm up imports and connections
    started = time.monotonic()
    doc = status.collect(config, src)
    elapsed = time.monotonic() - started
    assert doc["state"] == probes.OK, json.dumps(doc["parts"], indent=1)
    assert elapsed < 0.3, elapsed
    assert list(doc["parts"]) == list(status.PARTS)
    eng = doc["parts"]["engine"]
    assert eng["models"] == [MODEL]
    assert eng["metrics"]["requests_running"] == 0
    assert doc["parts"]["verify"]["signer"] == "release-2026"
    assert doc["parts"]["gpu"]["state"] == probes.OK  # recorded MI300X: 0.3 of 192 GiB used
    assert doc["parts"]["os"]["boot_counting"]["state"] == probes.NOT_CONFIGURED

    monkeypatch.setenv("APPLIANCE_CONFIG", str(tree / "appliance.json"))
    (tree / "appliance.json").write_text(json.dumps(config))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert status.run(argparse.Namespace(json=True), src) == 0
    assert json.loads(out.getvalue())["schema"] == 1


def test_hung_engine_answers_within_2_seconds_and_is_down(
    tree: Path, config: dict[str, Any], hung_engine: str, systemd_mock: MockSystemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_healthy(tree, config)
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tree / "appliance.json"))
    (tree / "appliance.json").write_text(json.dumps(config))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    started = time.monotonic()
    code = status.run(argparse.Namespace(json=False), sources(tree, hung_engine, systemd_mock))
    assert time.monotonic() - started < 2.0
    assert code == 2
    text = out.getvalue()
    assert "engine" in text and "no answer within 0.5 s" in text
    assert "\033[" not in text  # not a terminal: no colour


def test_a_probe_that_hangs_or_raises_is_down_and_costs_only_the_deadline() -> None:
    def hang() -> probes.Part:
        time.sleep(30)
        raise AssertionError

    def boom() -> probes.Part:
        raise RuntimeError("broken\nsecond line")

    started = time.monotonic()
    parts = probes.run_probes({"a": hang, "b": boom, "c": lambda: probes.Part(probes.OK)}, deadline_s=0.3)
    assert time.monotonic() - started < 0.6
    assert (parts["a"].state, parts["a"].reason) == (probes.DOWN, "no answer within 0.3 s")
    assert (parts["b"].state, parts["b"].reason) == (probes.DOWN, "probe failed: RuntimeError: broken")
    assert parts["c"].state == probes.OK


@pytest.mark.parametrize(
    ("states", "overall", "code"),
    [
        ([probes.OK, probes.NOT_CONFIGURED], probes.OK, 0),
        ([probes.OK, probes.DEGRADED, probes.NOT_CONFIGURED], probes.DEGRADED, 1),
        ([probes.DEGRADED, probes.DOWN, probes.OK], probes.DOWN, 2),
    ],
)
def test_overall_state_and_exit_status(states: list[str], overall: str, code: int) -> None:
    assert probes.worst(states) == overall
    assert status.EXIT_STATUS[overall] == code


def test_degraded_exit_status_and_colour(
    tree: Path, config: dict[str, Any], engine: str, systemd_mock: MockSystemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_healthy(tree, config)
    paths.STARTUP_REPORT.write_text(json.dumps({"state": "loading", "reason": "loading weights"}))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tree / "appliance.json"))
    (tree / "appliance.json").write_text(json.dumps(config))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert status.run(argparse.Namespace(json=True), sources(tree, engine, systemd_mock)) == 1
    doc = json.loads(out.getvalue())
    assert (doc["state"], doc["reason"]) == (probes.DEGRADED, "startup: loading weights")
    coloured = io.StringIO()
    status.render(doc, coloured, colour=True)
    assert "\033[33mdegraded" in coloured.getvalue()


# ----------------------------------------------------------------------------------- engine


def test_engine_refused_is_down_unless_it_is_loading(tree: Path, config: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    part = probes.probe_engine(config, sources(tree, url))
    assert (part.state, part.reason) == (probes.DOWN, f"{url}/health: connection refused")
    paths.STARTUP_REPORT.write_text(json.dumps({"state": "loading"}))
    doc = status.collect(config, dataclasses.replace(sources(tree, url), bus=lambda: None))
    assert doc["parts"]["engine"]["state"] == probes.DEGRADED
    assert doc["parts"]["engine"]["reason"].startswith("starting")


def test_engine_serving_another_model_is_degraded(tree: Path, config: dict[str, Any]) -> None:
    port = free_port()
    proc = start_standin(port, name="someone/else")
    try:
        part = probes.probe_engine(config, sources(tree, f"http://127.0.0.1:{port}"))
    finally:
        stop(proc)
    assert (part.state, part.reason) == (probes.DEGRADED, f"/v1/models does not list {MODEL}")


# ----------------------------------------------------------------------------------- os


def _partition(tree: Path, name: str, number: int, label: str, uuid: str) -> None:
    dev = tree / "dev" / name
    dev.parent.mkdir(exist_ok=True)
    dev.touch()
    for d, link in ((tree / "by-partlabel", label), (tree / "by-partuuid", uuid)):
        d.mkdir(exist_ok=True)
        (d / link).symlink_to(dev)
    (tree / "sys-class-block" / name).mkdir(parents=True)
    (tree / "sys-class-block" / name / "partition").write_text(f"{number}\n")


def _efivar(tree: Path, entry: str) -> None:
    (tree / "efivars").mkdir(exist_ok=True)
    var = tree / "efivars" / f"LoaderEntrySelected-{probes.EFI_LOADER_GUID}"
    var.write_bytes(b"\x06\x00\x00\x00" + (entry + "\0").encode("utf-16-le"))


@pytest.mark.parametrize(("booted_hash", "slot", "version"), [("a" * 64, "A", "1.0.0"), ("b" * 64, "B", "1.1.0")])
def test_booted_slot_from_usrhash(
    tree: Path, config: dict[str, Any], booted_hash: str, slot: str, version: str
) -> None:
    _partition(tree, "vda2", 2, "appliance_1.0.0", "aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa")
    _partition(tree, "vda3", 3, "appliance_1.0.0_verity", "cccccccc-cccc-cccc-cccc-cccccccccccc")
    _partition(tree, "vda5", 5, "appliance_1.1.0", "bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb")
    (tree / "cmdline").write_text(f"console=ttyS0 usrhash={booted_hash} ro\n")
    part = probes.probe_os(config, sources(tree, "http://127.0.0.1:1"))
    assert part.details["usr"]["slot"] == slot
    assert part.details["usr"]["version"] == version
    assert part.details["usr"]["source"] == "usrhash"


def test_boot_counting_states(tree: Path, config: dict[str, Any]) -> None:
    src = sources(tree, "http://127.0.0.1:1")
    assert probes.probe_os(config, src).details["boot_counting"]["state"] == probes.NOT_CONFIGURED
    _efivar(tree, "appliance_1.0.0+2-1.efi")
    part = probes.probe_os(config, src)
    assert part.state == probes.OK
    assert part.details["boot_counting"] == {
        "entry": "appliance_1.0.0+2-1.efi",
        "state": "on trial",
        "tries_left": 2,
        "tries_done": 1,
    }
    _efivar(tree, "appliance_1.0.0+0-3.efi")
    part = probes.probe_os(config, src)
    assert part.state == probes.DEGRADED
    assert "no tries left" in part.reason
    _efivar(tree, "appliance_1.0.0.efi")
    assert probes.probe_os(config, src).details["boot_counting"]["state"] == "not counting"


def test_os_version_mismatch_is_degraded(tree: Path, config: dict[str, Any]) -> None:
    (tree / "os-release").write_text("IMAGE_VERSION=0.9.0\n")
    part = probes.probe_os(config, sources(tree, "http://127.0.0.1:1"))
    assert part.state == probes.DEGRADED
    assert "image version 0.9.0" in part.reason


# ----------------------------------------------------------------------------------- files


def test_startup_report_states(tree: Path, config: dict[str, Any]) -> None:
    assert probes.probe_startup(config).state == probes.NOT_CONFIGURED
    figures = {"model_memory_gib": 0.5, "kv_cache_tokens": 32768, "cuda_graphs": "FULL", "ready": True}
    report = {"state": "degraded", "reason": "KV cache 32768 tokens < 65536", "figures": figures}
    paths.STARTUP_REPORT.write_text(json.dumps(report))
    part = probes.probe_startup(config)
    assert (part.state, part.reason) == (probes.DEGRADED, "KV cache 32768 tokens < 65536")
    assert part.details["figures"]["kv_cache_tokens"] == {"value": 32768, "expected": 65536}
    paths.STARTUP_REPORT.write_text(json.dumps({**report, "state": "ok", "reason": ""}))
    assert probes.probe_startup(config).state == probes.OK
    paths.STARTUP_REPORT.write_text("{half")
    assert probes.probe_startup(config).state == probes.DEGRADED


@pytest.mark.parametrize("name", ["VERIFY_RESULT", "PREFLIGHT_RESULT", "SHM_CHECK"])
def test_check_files(tree: Path, name: str) -> None:
    path: Path = getattr(paths, name)
    assert probes.probe_check(path, "x").state == probes.NOT_CONFIGURED
    path.write_text(json.dumps({"ok": True, "reason": "", "version": "1.0.0"}))
    part = probes.probe_check(path, "x")
    assert (part.state, part.details) == (probes.OK, {"version": "1.0.0"})
    path.write_text(json.dumps({"ok": False, "reason": "signature does not match any trusted key"}))
    assert probes.probe_check(path, "x").to_json() == {
        "state": probes.DOWN,
        "reason": "signature does not match any trusted key",
    }
    path.write_text("[]")
    assert probes.probe_check(path, "x").state == probes.DEGRADED


def test_shm_offload_files_stale_or_in_use(tree: Path, config: dict[str, Any]) -> None:
    src = probes.Sources(proc=Path("/proc"))
    assert probes.probe_shm(config, src).state == probes.OK
    live = paths.SHM_DIR / "vllm_offload_live.mmap"
    live.write_bytes(b"\0" * 4096)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # this process maps it, like an engine
        part = probes.probe_shm(config, src)
        assert part.state == probes.OK, part.reason
        assert part.details["offload_files"][0]["in_use"] is True
        (paths.SHM_DIR / "vllm_offload_dead.mmap").write_bytes(b"\0" * 4096)
        part = probes.probe_shm(config, src)
    assert part.state == probes.DEGRADED
    assert part.details["stale_offload_files"] == ["vllm_offload_dead.mmap"]
    assert "Bad address" in part.reason


def test_shm_too_small_absent_or_unused(tree: Path, config: dict[str, Any]) -> None:
    src = probes.Sources(proc=Path("/proc"))
    big = {**config, "engine": {**config["engine"], "offload_gib": 1e6}}
    assert probes.probe_shm(big, src).state == probes.DEGRADED
    paths.SHM_DIR.rmdir()
    assert probes.probe_shm(config, src).state == probes.DOWN
    none = {**config, "engine": {**config["engine"], "offload_gib": 0.0}}
    assert probes.probe_shm(none, src).state == probes.NOT_CONFIGURED


def test_disk(tree: Path, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    (Path(config["model"]["cache_dir"]) / "blob").write_bytes(b"x" * 10000)
    part = probes.probe_disk(config)
    assert part.state == probes.OK, part.reason
    assert part.details["model_cache"]["cache_bytes"] >= 10000
    monkeypatch.setattr(probes, "DISK_MIN_FREE_BYTES", 1 << 60)
    assert probes.probe_disk(config).state == probes.DEGRADED
    assert probes.probe_disk(config, tree / "missing").state == probes.DOWN


def test_tls(tree: Path, config: dict[str, Any]) -> None:
    part = probes.probe_tls(config)
    assert (part.state, part.reason) == (
        probes.NOT_CONFIGURED,
        f"{paths.TLS_DIR / 'ca.crt'} absent: no appliance CA yet",
    )
    make_ca(paths.TLS_DIR / "ca.crt", days=365)
    part = probes.probe_tls(config)
    assert part.state == probes.OK
    assert len(part.details["ca_sha256"]) == 95 and part.details["ca_days_left"] in (364, 365)
    make_ca(paths.TLS_DIR / "ca.crt", days=10)
    assert probes.probe_tls(config).state == probes.DEGRADED
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=20)
    assert probes.probe_tls(config, now=later).state == probes.DOWN
    (paths.TLS_DIR / "ca.crt").write_text("not a certificate")
    assert probes.probe_tls(config).state == probes.DOWN


def test_the_slots_line_names_versions_the_booted_slot_and_trials() -> None:
    good = {"slot": "B", "version": "1.0.1", "state": "good", "booted": True, "tries_left": None}
    trial = {"slot": "A", "version": "1.0.2", "state": "on trial", "booted": False, "tries_left": 2}
    empty = {"slot": "B", "version": None, "state": "empty", "booted": False, "tries_left": None}
    assert status.slots_line([trial, good]) == "A 1.0.2 on trial (2 tries left); B 1.0.1 booted, good"
    assert status.slots_line([{**good, "slot": "A", "version": "1.0.0"}, empty]) == "A 1.0.0 booted, good; B empty"
