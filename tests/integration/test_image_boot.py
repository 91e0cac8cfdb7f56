# SPDX-License-Identifier: MIT
"""The demo image boots in QEMU as the appliance it claims to be."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.integration

GIB = 1024**3


def _partitions(report: dict[str, Any]) -> list[dict[str, Any]]:
    table = report["partitions"]["partitiontable"]
    return list(table["partitions"])


def test_no_failed_units(first_boot: dict[str, Any]) -> None:
    assert first_boot["failed_units"] == [], first_boot["status_text"]


def test_usr_is_read_only_erofs_on_dm_verity(first_boot: dict[str, Any]) -> None:
    source, fstype, options = first_boot["usr_mount"]
    assert source == "/dev/mapper/usr"
    assert fstype == "erofs"
    assert options.split(",")[0] == "ro"
    assert "type:        VERITY" in first_boot["usr_verity"]
    assert "status:      verified" in first_boot["usr_verity"] or "is active" in first_boot["usr_verity"]
    assert "usrhash=" in first_boot["cmdline"]


def test_empty_b_slot_is_reserved_with_the_size_of_a(first_boot: dict[str, Any]) -> None:
    usr_type = "8484680C-9521-48C6-9C11-B0720656F69E"  # x86-64 /usr
    verity_type = "77FF5F63-E7B6-4633-ACF4-1565B864C0E6"  # x86-64 /usr verity
    parts = _partitions(first_boot)
    usr = [p for p in parts if p["type"].upper() == usr_type]
    verity = [p for p in parts if p["type"].upper() == verity_type]
    assert len(usr) == 2 and len(verity) == 2, parts
    assert [p["name"] for p in usr].count("_empty") == 1
    assert usr[0]["size"] == usr[1]["size"]
    assert [p["name"] for p in verity].count("_empty") == 1


def test_root_and_var_grown_on_first_boot(first_boot: dict[str, Any]) -> None:
    mounts = {fs["target"]: fs for fs in first_boot["filesystems"]["filesystems"]}
    assert int(mounts["/"]["size"]) > 0.8 * GIB  # built minimal, grown to 1 GiB by systemd-repart
    assert "rw" in mounts["/"]["options"].split(",")
    assert mounts["/var"]["source"] != mounts["/"]["source"]
    assert int(mounts["/var"]["size"]) > 4 * GIB  # created on first boot from the free space


def test_applianctl_installed_as_a_command(first_boot: dict[str, Any]) -> None:
    assert first_boot["applianctl_version"].startswith("applianctl ")


def test_the_first_boot_fetched_the_demo_weights_and_status_shows_them_verified(first_boot: dict[str, Any]) -> None:
    """The demo pins generated weights; the guest fetched them from the build
    host's mirror at its first boot (appliance-model-fetch.service) and the start check found
    every file sealed with its signed digest before the engine started."""
    weights = first_boot["status"]["parts"]["weights"]
    assert weights["state"] == "ok" and weights["verified"] is True, weights
    assert weights["files"] == 5 and weights["source"].startswith("https://10.0.2.2:"), weights
    assert first_boot["status"]["parts"]["engine"]["state"] == "ok", first_boot["status"]["parts"]["engine"]


def test_the_boot_menu_offers_a_factory_reset_and_boots_the_main_entry(first_boot: dict[str, Any]) -> None:
    """Each kernel image carries the factory reset entries (UKI profiles, signed with it); the default
    pattern in loader.conf keeps every plain boot on the main entry (the upgrades' trial boots in
    the journey would otherwise wipe /var)."""
    entries = first_boot["boot_entries"]
    titles = [str(e["title"]) for e in entries]
    assert len([t for t in titles if "Factory reset: wipe /var" in t]) >= 2, titles
    assert any("keep the host settings and the weights" in t for t in titles), titles
    selected = [e for e in entries if e["isSelected"]]
    assert len(selected) == 1 and "@" not in str(selected[0]["id"]), entries
