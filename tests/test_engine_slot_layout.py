# SPDX-License-Identifier: MIT
"""Engine slots on the disk: the setting engine.slot_size_gib, the partitions the build
and the first boot make for both slots (rendered, then laid out by the real systemd-repart on a
plain image file), the fit of the engine store, and how the engine-store unit finds the slot it
opens, against `lsblk --json -O -b` outputs recorded in QEMU guests (tests/fixtures/disks/)."""

from __future__ import annotations

import configparser
import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import applianctl.slots.engine
from appliance import config, paths
from appliance.errors import UserError
from appliance.signed.bundle_index import ENGINE_TYPE, ENGINE_VERITY_TYPE
from applianctl.records import EngineSlotOpened
from applianctl.slots.partitions import Partition
from builder import engine_store, render, validate

ROOT = Path(__file__).resolve().parents[1]
DISKS = Path(__file__).resolve().parent / "fixtures" / "disks"
STATIC_FIRST_BOOT = ROOT / "image" / "mkosi.extra" / "usr" / "lib" / "repart.d"
BUILD_REPART = ROOT / "image" / "mkosi.repart"
MIB, GIB = 1 << 20, 1 << 30
LINUX_GENERIC = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"


@pytest.fixture(scope="module", params=["production", "demo"])
def profile(request: pytest.FixtureRequest) -> config.Config:
    return config.load(ROOT / "appliance.toml", request.param)


def _ini(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return dict(parser["Partition"])


def _store(c: config.Config, tmp: Path, size: int = 45056) -> engine_store.EngineStore:
    erofs, verity = tmp / "engine.erofs", tmp / "engine.verity"
    erofs.write_bytes(b"e" * size)
    verity.write_bytes(b"v" * engine_store.hash_tree_bytes(size))
    return engine_store.EngineStore(erofs, verity, "ab" * 32, engine_store.label_for(c.engine.digest))


# ----------------------------------------------------------------------------------- the setting


def test_the_profiles_size_their_slots() -> None:
    assert config.load(ROOT / "appliance.toml", "production").engine.slot_bytes == 40 * GIB
    assert config.load(ROOT / "appliance.toml", "demo").engine.slot_bytes == 64 * MIB


@pytest.mark.programs
@pytest.mark.parametrize("value", ["0.1", "0", "-1", "0.0078125", "2000000", '"40"', "inf", "nan"])
def test_a_bad_slot_size_is_one_line_exit_2(tmp_path: Path, value: str) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text((ROOT / "appliance.toml").read_text().replace("\nslot_size_gib = 40\n", f"\nslot_size_gib = {value}\n", 1))
    proc = subprocess.run(
        [shutil.which("python3") or "python3", "-m", "builder", "validate", "--config", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 2 and "engine.slot_size_gib" in lines[0] and lines[1].startswith("hint: "), lines
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["0.015625", "0.0625", "1.5", "40", "512"])
def test_a_slot_size_of_whole_mib_is_taken(tmp_path: Path, value: str) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text((ROOT / "appliance.toml").read_text().replace("\nslot_size_gib = 40\n", f"\nslot_size_gib = {value}\n", 1))
    assert config.load(path).engine.slot_bytes == int(float(value) * 1024) * MIB


# ----------------------------------------------------------------------------------- the store must fit


@pytest.mark.programs
@pytest.mark.parametrize("mib", [1, 16, 64, 513])
def test_the_hash_tree_size_is_what_veritysetup_writes(tmp_path: Path, mib: int) -> None:
    if shutil.which("veritysetup") is None:
        pytest.skip("veritysetup (cryptsetup-bin) is not installed")
    data, tree = tmp_path / "data", tmp_path / "tree"
    with data.open("wb") as f:
        f.truncate(mib * MIB)
    subprocess.run(["veritysetup", "format", str(data), str(tree)], check=True, capture_output=True)
    assert tree.stat().st_size == engine_store.hash_tree_bytes(mib * MIB)
    assert engine_store.verity_slot_bytes(mib * MIB) >= tree.stat().st_size


def test_a_store_larger_than_the_slot_is_refused_by_build_and_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = config.load(ROOT / "appliance.toml", "demo")
    fits = engine_store.check_fits(_store(demo, tmp_path), demo)
    assert fits.slot_bytes == 64 * MIB
    big = _store(demo, tmp_path, 64 * MIB + 1)
    with pytest.raises(UserError) as e:
        engine_store.check_fits(big, demo)
    assert "more than an engine slot (engine.slot_size_gib = 0.0625, 64 MiB)" in e.value.message
    assert "at least 0.0634765625" in (e.value.hint or "")  # 65 MiB: the next whole MiB
    monkeypatch.setattr(engine_store, "built", lambda c: big)
    assert [p.message for p in validate._slot_problems(demo)] == [e.value.message]
    monkeypatch.setattr(engine_store, "built", lambda c: None)
    assert validate._slot_problems(demo) == []


def test_an_unsized_store_gets_no_partitions(tmp_path: Path) -> None:
    demo = config.load(ROOT / "appliance.toml", "demo")
    with pytest.raises(UserError, match=r"not checked against engine\.slot_size_gib"):
        render.repart_definitions(_store(demo, tmp_path), tmp_path / "repart")


# ----------------------------------------------------------------------------------- the rendered definitions


def test_slot_a_at_build_has_the_engine_types_and_a_full_slot(profile: config.Config, tmp_path: Path) -> None:
    store = engine_store.check_fits(_store(profile, tmp_path), profile)
    render.repart_definitions(store, tmp_path / "repart")
    slot, verity = profile.engine.slot_bytes, engine_store.verity_slot_bytes(profile.engine.slot_bytes)
    assert sorted(p.name for p in (tmp_path / "repart").iterdir()) == ["15-engine-store.conf", "16-engine-store-verity.conf"]
    data = _ini(tmp_path / "repart" / "15-engine-store.conf")
    hashes = _ini(tmp_path / "repart" / "16-engine-store-verity.conf")
    assert data == {"Type": ENGINE_TYPE, "Label": store.label, "CopyBlocks": "/engine-partition/engine.erofs",
                    "SizeMinBytes": str(slot), "SizeMaxBytes": str(slot), "SplitName": "engine"}
    assert hashes == {"Type": ENGINE_VERITY_TYPE, "Label": store.label + "-verity", "CopyBlocks": "/engine-partition/engine.verity",
                      "SizeMinBytes": str(verity), "SizeMaxBytes": str(verity), "SplitName": "engine-verity"}


def test_first_boot_definitions_match_a_and_make_b_before_var(profile: config.Config, tmp_path: Path) -> None:
    written = render.first_boot_repart(profile, tmp_path)
    slot, verity = profile.engine.slot_bytes, engine_store.verity_slot_bytes(profile.engine.slot_bytes)
    assert [p.name for p in written] == ["15-engine-a.conf", "16-engine-a-verity.conf", "25-engine-b.conf", "26-engine-b-verity.conf"]
    for path, type_uuid, size in zip(written, (ENGINE_TYPE, ENGINE_VERITY_TYPE) * 2, (slot, verity) * 2, strict=True):
        assert _ini(path) == {"Type": type_uuid, "Label": "_empty", "SizeMinBytes": str(size), "SizeMaxBytes": str(size),
                              "Priority": "1"}, path.name
    order = sorted([*(p.name for p in STATIC_FIRST_BOOT.iterdir()), *(p.name for p in written)])
    # slot A's definitions before slot B's (existing partitions match the first of their type),
    # slot B after /usr B and before /var, which takes the rest of the disk
    assert order.index("13-usr-b-verity.conf") < order.index("25-engine-b.conf") < order.index("30-var.conf") == len(order) - 1
    assert order.index("16-engine-a-verity.conf") < order.index("25-engine-b.conf")


def test_the_generated_tree_carries_the_first_boot_definitions(tmp_path: Path) -> None:
    demo = config.load(ROOT / "appliance.toml", "demo")
    store = engine_store.check_fits(_store(demo, tmp_path), demo)
    render.generate_tree(demo, tmp_path / "tree", store)
    names = sorted(p.name for p in (tmp_path / "tree" / render.FIRST_BOOT_REPART).iterdir())
    assert names == ["15-engine-a.conf", "16-engine-a-verity.conf", "25-engine-b.conf", "26-engine-b-verity.conf"]
    assert not set(names) & {p.name for p in STATIC_FIRST_BOOT.iterdir()}, "a generated file would hide a static one"


# ----------------------------------------------------------------------------------- the real systemd-repart

REPART = shutil.which("systemd-repart")
needs_repart = pytest.mark.skipif(REPART is None, reason="systemd-repart is not installed")


def _build_stand_ins(directory: Path) -> None:
    """image/mkosi.repart/ as partition sizes, types and labels only (no file systems: mkosi's job)."""
    directory.mkdir(parents=True)
    for source in sorted(BUILD_REPART.glob("*.conf")):
        keys = {k: v.replace("%A", "1.0.0") for k, v in _ini(source).items() if k in ("Type", "Label", "SizeMinBytes", "SizeMaxBytes")}
        (directory / source.name).write_text("[Partition]\n" + "".join(f"{k}={v}\n" for k, v in keys.items()))


def _repart(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPART), "--no-pager", *map(str, args)], capture_output=True, text=True, timeout=120)


def _image(tmp: Path, c: config.Config, old_types: bool = False) -> Path:
    """An appliance image as the build lays it out: stand-ins for ESP, /usr A and root, and engine
    slot A from builder/render.py with the store's blocks."""
    root = tmp / "root"
    (root / "engine-partition").mkdir(parents=True)
    store = engine_store.check_fits(_store(c, root / "engine-partition"), c)
    definitions = tmp / "build"
    _build_stand_ins(definitions)
    render.repart_definitions(store, definitions)
    if old_types:  # what older images wrote (slots typed linux-generic)
        for conf in definitions.glob("1[56]-engine-store*.conf"):
            text = conf.read_text().replace(ENGINE_TYPE, "linux-generic").replace(ENGINE_VERITY_TYPE, "linux-generic")
            conf.write_text("".join(line + "\n" for line in text.splitlines() if not line.startswith("Size")))
    image = tmp / "appliance.raw"
    proc = _repart("--empty=create", "--size=auto", f"--definitions={definitions}", f"--root={root}", "--dry-run=no", image)
    assert proc.returncode == 0, proc.stderr
    return image


def _first_boot(tmp: Path, c: config.Config, image: Path, size: str | None = "12G") -> subprocess.CompletedProcess[str]:
    definitions = tmp / "first-boot"
    shutil.rmtree(definitions, ignore_errors=True)
    shutil.copytree(STATIC_FIRST_BOOT, definitions)
    render.first_boot_repart(c, definitions)
    grow = [f"--size={size}"] if size else []  # the disk as the QEMU journey gives it; None: as it is
    return _repart(f"--definitions={definitions}", "--dry-run=yes", *grow, "--json=short", image)


@pytest.mark.programs
@needs_repart
def test_first_boot_lays_out_both_engine_slots(profile: config.Config, tmp_path: Path) -> None:
    image = _image(tmp_path, profile)  # a sparse file: the production one's 40 GiB slot costs nothing
    proc = _first_boot(tmp_path, profile, image, "12G" if profile.profile == "demo" else "120G")
    assert proc.returncode == 0, proc.stderr
    layout = sorted(json.loads(proc.stdout), key=lambda p: p["offset"])
    label = engine_store.label_for(profile.engine.digest)
    slot, verity = profile.engine.slot_bytes, engine_store.verity_slot_bytes(profile.engine.slot_bytes)
    assert [(p["file"], p["label"], p["activity"]) for p in layout] == [
        ("00-esp.conf", "esp", "unchanged"),
        ("10-usr-a.conf", "appliance_1.0.0", "unchanged"),
        ("11-usr-a-verity.conf", "appliance_1.0.0_verity", "unchanged"),
        ("11-usr-a-verity-sig.conf", "appliance_1.0.0_verity_sig", "unchanged"),
        ("15-engine-a.conf", label, "unchanged"),  # matched by type; its label is never changed
        ("16-engine-a-verity.conf", label + "-verity", "unchanged"),
        ("20-root.conf", "root-x86-64", "resize"),
        ("12-usr-b.conf", "_empty", "create"),
        ("13-usr-b-verity-sig.conf", "_empty", "create"),  # "-sig" sorts before ".conf"
        ("13-usr-b-verity.conf", "_empty", "create"),
        ("25-engine-b.conf", "_empty", "create"),
        ("26-engine-b-verity.conf", "_empty", "create"),
        ("30-var.conf", "appliance-var", "create"),
    ]
    sizes = {p["file"]: p["raw_size"] for p in layout}
    assert sizes["15-engine-a.conf"] == sizes["25-engine-b.conf"] == slot
    # B's as systemd-repart makes it on first boot (its 10 MiB minimum for a partition without
    # contents, seen here), room for any release's signature (16 KiB as mkosi's repart writes it)
    assert 16384 <= sizes["13-usr-b-verity-sig.conf"] <= 10 << 20
    assert sizes["16-engine-a-verity.conf"] == sizes["26-engine-b-verity.conf"] == verity
    types = {p["file"]: p["type"].upper() for p in layout}
    assert types["15-engine-a.conf"] == types["25-engine-b.conf"] == ENGINE_TYPE
    assert types["16-engine-a-verity.conf"] == types["26-engine-b-verity.conf"] == ENGINE_VERITY_TYPE


@pytest.mark.programs
@needs_repart
def test_a_disk_from_before_engine_types_still_boots(tmp_path: Path) -> None:
    """Its /var holds the rest of the disk: the engine definitions are dropped (Priority=1), the
    first boot does not fail; the engine-store unit then refuses its untyped slot (below)."""
    demo = config.load(ROOT / "appliance.toml", "demo")
    image = _image(tmp_path, demo, old_types=True)
    old = tmp_path / "old-first-boot"
    shutil.copytree(STATIC_FIRST_BOOT, old)
    var = old / "30-var.conf"  # no file system on a plain file here: systemd-repart would need a loop device
    kept = [line for line in var.read_text().splitlines() if not line.startswith(("Format=", "MakeDirectories=", "Encrypt="))]
    var.write_text("".join(line + "\n" for line in kept))
    made = _repart(f"--definitions={old}", "--dry-run=no", "--size=12G", image)
    assert made.returncode == 0, made.stderr
    proc = _first_boot(tmp_path, demo, image, size=None)
    assert proc.returncode == 0, proc.stderr
    layout = json.loads(proc.stdout)
    engine = ("15-engine", "16-engine", "25-engine", "26-engine")
    assert not [p for p in layout if p["file"].startswith(engine) and p["activity"] == "create"]
    assert "dropping" in proc.stderr


# ----------------------------------------------------------------------------------- which slot the unit opens


def _recorded(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DISKS / name).read_text())["lsblk"]
    return doc


def _typed(doc: dict[str, Any]) -> dict[str, Any]:
    """DOC as a disk written by an image of this issue: the engine partitions carry their types."""
    doc = copy.deepcopy(doc)
    for disk in doc["blockdevices"]:
        for part in disk.get("children") or []:
            label = part.get("partlabel") or ""
            if label.startswith("engine_"):
                part["parttype"] = (ENGINE_VERITY_TYPE if label.endswith("-verity") else ENGINE_TYPE).lower()
    return doc


LABEL = "engine_6fe62b3716e5"  # the demo stand-in's, on every recorded disk


@pytest.mark.parametrize("name", ["four-nvme.json", "installer-usb.json", "nvme-with-gpt.json", "one-nvme.json"])
def test_the_slot_of_the_manifest_is_found_on_the_usr_disk(name: str) -> None:
    doc = _typed(_recorded(name))
    disk = applianctl.slots.engine.usr_disk_node(doc)["path"]
    assert applianctl.slots.engine.locate(doc, LABEL) == (f"{disk}4", f"{disk}5")


def test_an_untyped_slot_is_refused() -> None:
    """The recorded disks are today's images (linux-generic): the right label, the wrong type."""
    with pytest.raises(UserError) as e:
        applianctl.slots.engine.locate(_recorded("four-nvme.json"), LABEL)
    assert e.value.message == f"/dev/vda: no partition labelled {LABEL} with the engine type: refused"
    assert "0fc63daf-8483-4772-8e79-3d69d8477de4" in (e.value.hint or "")


def test_a_second_partition_with_the_label_is_refused() -> None:
    doc = _typed(_recorded("four-nvme.json"))
    vda = next(d for d in doc["blockdevices"] if d["path"] == "/dev/vda")
    twin = copy.deepcopy(next(p for p in vda["children"] if p.get("partlabel") == LABEL + "-verity"))
    twin.update(path="/dev/vda10", name="vda10", children=[])
    vda["children"].append(twin)
    with pytest.raises(UserError, match=rf"2 partitions are labelled {LABEL}-verity \(/dev/vda5, /dev/vda10\): refused"):
        applianctl.slots.engine.locate(doc, LABEL)


def test_a_decoy_on_another_disk_is_never_opened() -> None:
    """The same label and type on another disk (a second appliance disk, a USB stick) is ignored;
    without the slot on /usr's disk, nothing is opened."""
    doc = _typed(_recorded("four-nvme.json"))
    vda = next(d for d in doc["blockdevices"] if d["path"] == "/dev/vda")
    other = next(d for d in doc["blockdevices"] if d.get("children") and d["path"] != "/dev/vda")
    decoys = [copy.deepcopy(p) for p in vda["children"] if (p.get("partlabel") or "").startswith("engine_")]
    for i, part in enumerate(decoys):
        part.update(path=f"{other['path']}p{i + 7}", children=[])
    other["children"] += decoys
    assert applianctl.slots.engine.locate(doc, LABEL) == ("/dev/vda4", "/dev/vda5")
    vda["children"] = [p for p in vda["children"] if not (p.get("partlabel") or "").startswith("engine_")]
    with pytest.raises(UserError, match=f"/dev/vda: no partition labelled {LABEL} with the engine type"):
        applianctl.slots.engine.locate(doc, LABEL)


def test_without_usr_or_with_a_bad_label_nothing_is_opened() -> None:
    with pytest.raises(UserError, match="no disk holds the mounted /usr"):
        applianctl.slots.engine.locate(_recorded("build-host.json"), LABEL)
    with pytest.raises(UserError, match="is not an engine slot label"):
        applianctl.slots.engine.locate(_typed(_recorded("four-nvme.json")), "appliance_1.0.0")


class Runner:
    """appliance.run.run's stand-in: records each argv, answers lsblk with DOC."""

    def __init__(self, doc: dict[str, Any], fail: str | None = None) -> None:
        self.doc, self.fail, self.calls = doc, fail, []  # type: ignore[var-annotated]

    def __call__(self, argv: list[str], what: str, hint: str) -> str:
        self.calls.append(list(argv))
        if argv[0] == self.fail:
            raise UserError(f"{what} failed: Verification of root hash failed.", hint=hint)
        return json.dumps(self.doc) if argv[0] == "lsblk" else ""


def test_open_pins_the_root_hash_and_records_the_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "RUN_DIR", tmp_path)
    runner = Runner(_typed(_recorded("four-nvme.json")))
    record = applianctl.slots.engine.open_slot(LABEL, "ab" * 32, runner)
    assert runner.calls == [["lsblk", "--json", "-O", "-b"],
                            ["veritysetup", "open", "/dev/vda4", "appliance-engine-store", "/dev/vda5", "ab" * 32]]
    assert json.loads((tmp_path / "engine-slot.json").read_text()) == record == {
        "label": LABEL, "partition": "/dev/vda4", "verity_partition": "/dev/vda5", "roothash": "ab" * 32}
    # status: the running slot is the one opened, whatever the digest says
    parts = [Partition(4, "/dev/vda4", ENGINE_TYPE, "", LABEL, 64 * MIB),
             Partition(5, "/dev/vda5", ENGINE_VERITY_TYPE, "", LABEL + "-verity", MIB),
             Partition(9, "/dev/vda9", ENGINE_TYPE, "", LABEL, 64 * MIB),
             Partition(10, "/dev/vda10", ENGINE_VERITY_TYPE, "", "_empty", MIB)]
    assert [s.running for s in applianctl.slots.engine.find(parts, None)] == [True, False]
    other = EngineSlotOpened(LABEL, "/dev/vda9", "/dev/vda10", "ab" * 32)
    assert [s.running for s in applianctl.slots.engine.find(parts, None, other)] == [False, True]
    assert [s.running for s in applianctl.slots.engine.find(parts, "sha256:6fe62b3716e5" + "0" * 52, False)] == [True, False]


def test_open_refuses_before_running_anything_on_a_bad_root_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "RUN_DIR", tmp_path)
    runner = Runner(_typed(_recorded("four-nvme.json")))
    with pytest.raises(UserError, match="root hash 'AB"):
        applianctl.slots.engine.open_slot(LABEL, "AB" * 32, runner)
    assert runner.calls == []
    failing = Runner(_typed(_recorded("four-nvme.json")), fail="veritysetup")
    with pytest.raises(UserError, match="veritysetup open failed"):
        applianctl.slots.engine.open_slot(LABEL, "ab" * 32, failing)
    assert not (tmp_path / "engine-slot.json").exists(), "nothing opened, nothing recorded"


def test_the_unit_command_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    doc = _recorded("four-nvme.json")  # untyped
    monkeypatch.setattr("appliance.run.run", Runner(doc))
    assert applianctl.slots.engine.main(["open", LABEL, "ab" * 32]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: /dev/vda: no partition labelled") and err[1].startswith("hint: ")


def test_the_unit_opens_through_the_helper(tmp_path: Path) -> None:
    demo = config.load(ROOT / "appliance.toml", "demo")
    store = engine_store.EngineStore(Path("/x"), Path("/y"), "ab" * 32, engine_store.label_for(demo.engine.digest))
    text = render.render_template("appliance-engine-store.service.j2", demo, store)
    starts = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ExecStart=")]
    assert starts[0] == f"/usr/bin/python3 -m applianctl.slots.engine open {store.label} {'ab' * 32}"
    assert "/dev/disk/by-partlabel" not in " ".join(starts), "a by-partlabel link may point at any disk's partition"
