# SPDX-License-Identifier: MIT
"""The journey's appliance was flashed by the installer onto a blank disk (conftest.installed), and
its per-host settings, from the signed install plan, survive the journey's upgrade and rollback."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import JOURNEY_HOSTNAME, opens_with, var_header
from journey import V1, V2, boot_reports, reports_of

from appliance import luks
from testkit.boot_report import Sealed

pytestmark = pytest.mark.integration


def test_the_installer_wrote_the_blank_disk_and_summarised(installed: dict[str, Any]) -> None:
    names = [p.get("name") for p in installed["table"]["partitiontable"]["partitions"]]
    # the release's partitions, slot B made empty and /var, as a first boot would
    assert "appliance-var" in names and f"appliance_{V1}" in names and "_empty" in names, names
    output = installed["output"]
    assert f"Appliance {V1} installed" in output, (output or installed["console"])[-3000:]
    assert "/usr " in output and "verified" in output  # the written /usr checked against the signed root hash


def _recovery_key(output: str) -> str:
    (key,) = [line.split()[1] for line in output.splitlines() if line.startswith(" RECOVERY ")]
    assert luks.RECOVERY_KEY.match(key), key
    return key


def test_the_installer_made_var_in_luks2_with_a_recovery_key_and_a_slot_only_the_signed_kernel_images_open(
    installed: dict[str, Any]
) -> None:
    """Read on the host from the disk as the installer left it: a TPM2 slot bound to the signed
    PCR 11 policy alone (the keys were not enrolled yet, so no PCR 7), the recovery key its summary
    shows, and no other way in (the install's own key file is wiped)."""
    assert not isinstance(installed["var_header"], str), installed["var_header"]
    methods, header = installed["var_header"]
    assert sorted((m.kind, m.pcrs, m.signed_pcrs) for m in methods) == [("recovery", (), ()), ("tpm2", (), (11,))], methods
    key = _recovery_key(installed["output"])
    assert opens_with(header, key)
    assert not opens_with(header, key.replace(key[0], "c" if key[0] != "c" else "b", 1))


def test_the_installer_enrolled_the_keys_and_every_later_boot_is_sealed(
    installed: dict[str, Any], journey_run1: dict[str, Any], journey_run2: dict[str, Any]
) -> None:
    """The journey's firmware starts in setup mode (no keys): the installer enrolls the appliance's
    keys, so the installed disk's first boot and every one after it enforce Secure Boot, with a TPM
    and the kernel image's signed PCR policy, and open /usr with its signed root hash (v1's slot A
    as installed, v2's and v3's slot B as the updater wrote it)."""
    output = installed["output"]
    assert "secure boot keys enrolled" in output, (output or installed["console"])[-3000:]
    boots = [*boot_reports(journey_run1), *boot_reports(journey_run2)]
    assert {V1, V2} <= {r.os_version for r in boots}
    for report in boots:
        version = report.os_version
        assert report.sealed == Sealed(secure_boot=True, setup_mode=False, tpm=True, pcr_signature=True), (version, report.sealed)
        # /var opened by the TPM with nobody at the console, on every version (no reseal), its
        # header holding the sealed slot and the recovery key only (the installer's slot replaced)
        part = report.status["parts"]["sealed"]
        assert (part.get("var_encrypted"), part.get("var_sealed"), part.get("var_recovery_key")) == (True, True, True), (version, part)
        kinds = sorted(u.split(" (slot")[0] for u in part.get("var_unlock") or [])
        assert kinds == ["recovery", "tpm2 PCR 7 + signed PCR 11"], (version, part)
        # /usr opened only with its root hash signature, which the kernel checked against db
        assert part.get("usr_signature") is True and report.usr_signature.file, (version, report.usr_signature)
        assert "the signature of /usr's root hash" in report.usr_signature.log, (version, report.usr_signature)


def test_var_is_sealed_to_pcr_7_after_the_journey_and_the_recovery_key_still_opens_it(
    installed: dict[str, Any], journey_run2: dict[str, Any]
) -> None:
    """Read on the host once the journey is over: the first sealed boot replaced the installer's slot
    with one bound to PCR 7 and the signed PCR 11 policy, and no upgrade or rollback resealed or
    added one."""
    header = var_header(installed["dir"] / "disk.raw", installed["table"], installed["dir"] / "var-header-after.img")
    assert not isinstance(header, str), header
    methods, copy = header
    assert sorted((m.kind, m.pcrs, m.signed_pcrs) for m in methods) == [("recovery", (), ()), ("tpm2", (7,), (11,))], methods
    assert opens_with(copy, _recovery_key(installed["output"]))


def _host(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["host"])


def test_the_plans_settings_hold_on_every_version_of_the_journey(
    installed: dict[str, Any], journey_run1: dict[str, Any], journey_run2: dict[str, Any]
) -> None:
    boots = [*reports_of(journey_run1), *reports_of(journey_run2)]
    versions = {r["status"]["parts"]["os"].get("version") for r in boots}
    assert {V1, V2} <= versions  # v1 as installed, v2 after the upgrade and after v3's rollback
    for report in boots:
        host = _host(report)
        assert host["source"] == "plan", host
        assert host["settings"]["hostname"] == JOURNEY_HOSTNAME, host
        assert host["settings"]["ssh_authorized_keys"] == [installed["ssh_line"]], host
