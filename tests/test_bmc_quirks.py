# SPDX-License-Identifier: MIT
"""builder/bmc_quirks.py on Redfish responses recorded from real BMCs and DMTF's mockups
(tests/fixtures/redfish/README.md says where each came from). A test that needs a state no
recording shows builds it from a recording, changes only what its source describes, and says so."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from builder import bmc_quirks
from builder.bmc_quirks import (
    QUIRKS,
    STANDARD,
    QuirkError,
    boot_override_body,
    boot_targets,
    db_certificates,
    free_cd_slot,
    insert_media_body,
    oem_media_config,
    oem_mount_request,
    profile_for,
    secure_boot_capability,
    slot_is_free,
    virtual_media_collections,
    virtual_media_members,
)

REDFISH = Path(__file__).parent / "fixtures" / "redfish"
ISO = "https://media.example/installer.iso"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REDFISH / name).read_text())
    return data


def read_from(mapping: dict[str, str]) -> Any:
    """read(path) over recordings: MAPPING names the fixture the BMC answered for each path."""
    def read(path: str) -> dict[str, Any]:
        return load(mapping[path])
    return read


# -- recognition ----------------------------------------------------------------------------------


def test_dmtf_mockup_is_standard() -> None:
    profile = profile_for(load("dmtf-rackmount1-serviceroot.json"), load("dmtf-rackmount1-manager.json"),
                          load("dmtf-rackmount1-system.json"))
    assert profile.name == "standard"
    assert profile.virtual_media == "manager" and not profile.insert_refuses and not profile.oem_mount
    assert "Contoso" in profile.detected


def test_idrac9_before_6_keeps_media_under_the_manager() -> None:
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), load("idrac9-3.34-manager.json"),
                          load("idrac9-3.34-system-r640.json"))
    assert profile.name == "dell-idrac"
    assert profile.virtual_media == "manager"
    assert profile.detected == "Dell 14G Monolithic 3.34.34.34"


def test_idrac9_from_6_00_02_uses_the_system() -> None:
    # Derived: the 3.34 recording with the version dell/iDRAC-Redfish-Scripting#265 reports.
    manager = {**load("idrac9-3.34-manager.json"), "FirmwareVersion": "6.10.30.00"}
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), manager, load("idrac9-3.34-system-r640.json"))
    assert profile.name == "dell-idrac9-6"
    assert profile.virtual_media == "system"
    older = {**manager, "FirmwareVersion": "6.00.00.00"}
    assert profile_for(load("idrac9-3.34-serviceroot.json"), older,
                       load("idrac9-3.34-system-r640.json")).name == "dell-idrac"


def test_idrac10_is_told_by_its_model_not_its_version() -> None:
    manager = load("idrac10-manager.json")
    assert manager["FirmwareVersion"].startswith("1.")
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), manager, load("idrac-system-r660-trimmed.json"))
    assert profile.name == "dell-idrac10"
    assert profile.virtual_media == "system"


def test_supermicro_x12_is_recognised_from_its_service_root() -> None:
    root = load("supermicro-x12-serviceroot.json")
    system = load("supermicro-x12-system.json")
    profile = profile_for(root, None, system)
    assert profile.name == "supermicro"
    assert profile.insert_refuses == {"Inserted", "WriteProtected"}
    assert profile.image_name_after_eject and profile.free_shows_not_connected
    assert not profile.oem_mount
    assert profile.source == "ansible-collections/community.general#4839"


def test_supermicro_is_recognised_from_the_system_alone() -> None:
    # A service root that names no vendor (Redfish before 1.5 has no Vendor): the System's
    # Manufacturer still tells.
    bare = {"@odata.id": "/redfish/v1", "RedfishVersion": "1.0.1"}
    assert profile_for(bare, None, load("supermicro-x12-system.json")).name == "supermicro"


def test_supermicro_with_a_vm1_collection_mounts_through_its_oem_call() -> None:
    # Derived: a Manager whose VirtualMedia link is Managers/1/VM1, the layout the recorded
    # VM1/CfgCD belongs to (quadsproject/badfish#394).
    manager = {"@odata.id": "/redfish/v1/Managers/1", "VirtualMedia": {"@odata.id": "/redfish/v1/Managers/1/VM1"}}
    profile = profile_for(load("supermicro-x12-serviceroot.json"), manager, load("supermicro-x12-system.json"))
    assert profile.name == "supermicro-oem-vm1"
    assert profile.oem_mount


def test_lenovo_looks_under_the_system_first() -> None:
    root = {"@odata.id": "/redfish/v1", "Vendor": "Lenovo"}
    profile = profile_for(root, {"Model": "XClarity Controller"}, {"Manufacturer": "Lenovo"})
    assert profile.name == "lenovo-xcc"
    assert profile.virtual_media == "system"


def test_an_unknown_vendor_gets_the_standard_path() -> None:
    root = {**load("dmtf-rackmount1-serviceroot.json"), "Vendor": "Acme BMC Works", "Oem": {"Acme": {}}}
    profile = profile_for(root, load("dmtf-rackmount1-manager.json"), load("dmtf-rackmount1-system.json"))
    assert profile == replace(STANDARD, detected=profile.detected)
    assert profile.name == "standard"


def test_every_row_names_a_public_source() -> None:
    upstream = re.compile(r"^[\w.-]+/[\w.-]+#\d+$|^https://")
    assert all(upstream.match(row.source) for row in QUIRKS)
    assert len({row.name for row in QUIRKS}) == len(QUIRKS)


def test_each_row_is_chosen_by_some_recording() -> None:
    chosen = {
        profile_for(load("idrac9-3.34-serviceroot.json"), load("idrac9-3.34-manager.json"),
                    load("idrac9-3.34-system-r640.json")).name,
        profile_for(load("idrac9-3.34-serviceroot.json"), load("idrac10-manager.json"),
                    load("idrac-system-r660-trimmed.json")).name,
        profile_for(load("supermicro-x12-serviceroot.json"), None, load("supermicro-x12-system.json")).name,
    }
    assert chosen <= {row.name for row in QUIRKS}
    assert len(chosen) == 3


# -- where the virtual media is -------------------------------------------------------------------


def test_dmtf_mockup_media_found_under_the_system_when_the_manager_has_none() -> None:
    profile = profile_for(load("dmtf-rackmount1-serviceroot.json"), load("dmtf-rackmount1-manager.json"),
                          load("dmtf-rackmount1-system.json"))
    read = read_from({"/redfish/v1/Systems/437XR1138R2/VirtualMedia": "dmtf-rackmount1-virtualmedia.json"})
    members = virtual_media_members(profile, load("dmtf-rackmount1-manager.json"),
                                    load("dmtf-rackmount1-system.json"), read)
    assert members == ["/redfish/v1/Systems/437XR1138R2/VirtualMedia/Floppy1",
                       "/redfish/v1/Systems/437XR1138R2/VirtualMedia/CD1"]


def test_idrac_media_found_under_the_system() -> None:
    manager, system = load("idrac10-manager.json"), load("idrac-system-r660-trimmed.json")
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), manager, system)
    read = read_from({"/redfish/v1/Systems/System.Embedded.1/VirtualMedia": "idrac-system-virtualmedia.json"})
    members = virtual_media_members(profile, manager, system, read)
    assert members == ["/redfish/v1/Systems/System.Embedded.1/VirtualMedia/2",
                       "/redfish/v1/Systems/System.Embedded.1/VirtualMedia/1"]


def test_idrac9_6_prefers_the_system_even_where_the_manager_still_links_media() -> None:
    # Derived: the 3.34 Manager (which links Managers/iDRAC.Embedded.1/VirtualMedia) at 6.10,
    # with the R660 System's VirtualMedia link.
    manager = {**load("idrac9-3.34-manager.json"), "FirmwareVersion": "6.10.30.00"}
    system = load("idrac-system-r660-trimmed.json")
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), manager, system)
    assert virtual_media_collections(profile, manager, system) == [
        "/redfish/v1/Systems/System.Embedded.1/VirtualMedia",
        "/redfish/v1/Managers/iDRAC.Embedded.1/VirtualMedia",
    ]


def test_idrac9_before_6_media_under_the_manager() -> None:
    manager, system = load("idrac9-3.34-manager.json"), load("idrac9-3.34-system-r640.json")
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), manager, system)
    assert virtual_media_collections(profile, manager, system) == ["/redfish/v1/Managers/iDRAC.Embedded.1/VirtualMedia"]


def test_supermicro_x12_system_points_at_the_managers_media() -> None:
    system = load("supermicro-x12-system.json")
    profile = profile_for(load("supermicro-x12-serviceroot.json"), None, system)
    assert virtual_media_collections(profile, None, system) == ["/redfish/v1/Managers/1/VirtualMedia"]


def test_no_media_collection_anywhere_is_a_clear_refusal() -> None:
    with pytest.raises(QuirkError, match="no VirtualMedia collection"):
        virtual_media_members(STANDARD, {"Model": "x"}, {"Manufacturer": "y"}, read_from({}))


# -- InsertMedia ----------------------------------------------------------------------------------


def test_standard_insert_sends_inserted_and_write_protected() -> None:
    assert insert_media_body(STANDARD, ISO) == {"Image": ISO, "Inserted": True, "WriteProtected": True}


def test_supermicro_insert_sends_the_image_alone() -> None:
    profile = profile_for(load("supermicro-x12-serviceroot.json"), None, load("supermicro-x12-system.json"))
    assert insert_media_body(profile, ISO) == {"Image": ISO}


def test_oem_mount_bmc_refuses_insert_media_and_gets_its_patch() -> None:
    manager = {"VirtualMedia": {"@odata.id": "/redfish/v1/Managers/1/VM1"}}
    profile = profile_for(load("supermicro-x12-serviceroot.json"), manager, load("supermicro-x12-system.json"))
    with pytest.raises(QuirkError, match="IsoConfig"):
        insert_media_body(profile, ISO)
    body, target = oem_mount_request(load("supermicro-x10-vm1-cfgcd.json"), ISO)
    assert body == {"Host": "https://media.example", "Path": "/installer.iso"}
    assert target == "/redfish/v1/Managers/1/VM1/CfgCD/Actions/IsoConfig.Mount"


def test_oem_mount_needs_the_mount_action() -> None:
    config = {k: v for k, v in load("supermicro-x10-vm1-cfgcd.json").items() if k != "Actions"}
    with pytest.raises(QuirkError, match=r"IsoConfig\.Mount"):
        oem_mount_request(config, ISO)


def test_oem_media_config_link() -> None:
    # The VM1 collection's shape, as quadsproject/badfish's tests describe it.
    collection = {"@odata.id": "/redfish/v1/Managers/1/VM1",
                  "Oem": {"Supermicro": {"VirtualMediaConfig": {"@odata.id": "/redfish/v1/Managers/1/VM1/CfgCD"}}}}
    assert oem_media_config(collection) == "/redfish/v1/Managers/1/VM1/CfgCD"
    assert oem_media_config(load("dmtf-rackmount1-virtualmedia.json")) is None


# -- is a slot free -------------------------------------------------------------------------------


def test_recorded_empty_idrac_slot_is_free() -> None:
    assert slot_is_free(STANDARD, load("idrac-system-virtualmedia-1.json"))


def test_recorded_dmtf_slots_in_use_are_not_free() -> None:
    assert not slot_is_free(STANDARD, load("dmtf-rackmount1-virtualmedia-cd1.json"))
    assert not slot_is_free(STANDARD, load("dmtf-rackmount1-virtualmedia-floppy1.json"))


def test_recorded_supermicro_slot_held_by_an_applet_is_not_free() -> None:
    profile = profile_for(load("supermicro-x12-serviceroot.json"), None, load("supermicro-x12-system.json"))
    assert not slot_is_free(profile, load("supermicro-x10-vm1-cd1-applet.json"))


def test_supermicro_slot_with_image_name_after_eject_is_free_when_not_connected() -> None:
    # Derived from the recorded CD1: after an eject, ansible-collections/community.general#6969
    # shows Inserted false and ConnectedVia NotConnected while ImageName stays.
    ejected = {**load("supermicro-x10-vm1-cd1-applet.json"), "Inserted": False, "ConnectedVia": "NotConnected"}
    profile = profile_for(load("supermicro-x12-serviceroot.json"), None, load("supermicro-x12-system.json"))
    assert ejected["ImageName"]
    assert slot_is_free(profile, ejected)
    assert not slot_is_free(STANDARD, ejected)  # the standard path trusts ImageName
    still_inserted = {**ejected, "Inserted": True}
    assert not slot_is_free(profile, still_inserted)


def test_free_cd_slot_skips_slots_that_take_no_iso() -> None:
    usb_only = {**load("idrac-system-virtualmedia-1.json"), "MediaTypes": ["USBStick"]}
    slots = {"/usb": usb_only, "/cd1": load("dmtf-rackmount1-virtualmedia-cd1.json"),
             "/idrac1": load("idrac-system-virtualmedia-1.json")}
    assert free_cd_slot(STANDARD, slots) == "/idrac1"
    assert free_cd_slot(STANDARD, {"/cd1": load("dmtf-rackmount1-virtualmedia-cd1.json")}) is None


# -- Secure Boot ----------------------------------------------------------------------------------


def test_dmtf_secure_boot_can_delete_pk_and_enroll_db() -> None:
    cap = secure_boot_capability(load("dmtf-rackmount1-system.json"), load("dmtf-rackmount1-secureboot.json"))
    assert cap.present and cap.enabled is False and cap.mode == "UserMode"
    assert cap.reset_keys_values == ("ResetAllKeysToDefault", "DeleteAllKeys", "DeletePK")
    assert cap.setup_mode_reset_type == "DeletePK"
    assert cap.can_enter_setup_mode and not cap.in_setup_mode
    assert cap.reset_keys_target == "/redfish/v1/Systems/437XR1138R2/SecureBoot/Actions/SecureBoot.ResetKeys"
    assert cap.databases == "/redfish/v1/Systems/437XR1138R2/SecureBoot/SecureBootDatabases"
    assert cap.can_enroll_db
    assert db_certificates(load("dmtf-rackmount1-secureboot-db.json")) == \
        "/redfish/v1/Systems/437XR1138R2/SecureBoot/SecureBootDatabases/db/Certificates"
    assert load("dmtf-rackmount1-secureboot-db-certificates.json")["@Redfish.SupportedCertificates"] == ["PEM"]


def test_secure_boot_that_lists_only_delete_all_keys() -> None:
    # Derived: the DMTF resource with ResetKeys limited the way its own db database lists them.
    sb = load("dmtf-rackmount1-secureboot.json")
    sb["Actions"]["#SecureBoot.ResetKeys"]["ResetKeysType@Redfish.AllowableValues"] = ["ResetAllKeysToDefault",
                                                                                       "DeleteAllKeys"]
    cap = secure_boot_capability(load("dmtf-rackmount1-system.json"), sb)
    assert cap.setup_mode_reset_type == "DeleteAllKeys"
    sb["Actions"]["#SecureBoot.ResetKeys"]["ResetKeysType@Redfish.AllowableValues"] = ["ResetAllKeysToDefault"]
    cap = secure_boot_capability(load("dmtf-rackmount1-system.json"), sb)
    assert cap.setup_mode_reset_type is None and not cap.can_enter_setup_mode


def test_idrac_secure_boot_in_setup_mode_without_databases() -> None:
    cap = secure_boot_capability(load("idrac9-3.34-system-r640.json"), load("idrac-secureboot.json"))
    assert cap.in_setup_mode and cap.can_enter_setup_mode
    assert cap.reset_keys_values is None  # not listed: its ActionInfo says
    assert cap.reset_keys_action_info == "/redfish/v1/Systems/System.Embedded.1/SecureBoot/ResetKeysActionInfo"
    assert not cap.can_enroll_db


def test_no_secure_boot_resource() -> None:
    system = {k: v for k, v in load("supermicro-x12-system.json").items() if k != "SecureBoot"}
    cap = secure_boot_capability(system, None)
    assert not cap.present and not cap.can_enter_setup_mode and not cap.can_enroll_db


# -- one-time boot --------------------------------------------------------------------------------


def test_boot_override_cd_once_in_uefi() -> None:
    # already in UEFI mode: the Mode is not sent again (a BMC may rebuild the firmware's settings on it)
    assert boot_override_body(STANDARD, "Cd", system=load("idrac9-3.34-system-r640.json")) == {
        "Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once"}}
    legacy = {"Boot": load("supermicro-x10-system-boot.json")}
    assert boot_override_body(STANDARD, "Cd", system=legacy) == {
        "Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once",
                 "BootSourceOverrideMode": "UEFI"}}
    assert boot_override_body(STANDARD, "Cd")["Boot"]["BootSourceOverrideMode"] == "UEFI"  # nothing shown: sent


def test_recorded_targets() -> None:
    assert "UefiHttp" in (boot_targets(load("idrac9-3.34-system-r640.json")) or ())
    assert "UefiHttp" in (boot_targets(load("supermicro-x12-system.json")) or ())
    assert "UefiHttp" not in (boot_targets(load("dmtf-rackmount1-system.json")) or ())
    # The X10 lists Cd twice; each value once here.
    x10 = {"Boot": load("supermicro-x10-system-boot.json")}
    assert boot_targets(x10) == ("None", "Pxe", "Hdd", "Cd", "BiosSetup", "Usb", "Floppy")


def test_boot_override_refuses_a_target_the_bmc_does_not_list() -> None:
    with pytest.raises(QuirkError, match="does not offer boot target UefiHttp"):
        boot_override_body(STANDARD, "UefiHttp", ISO, system=load("dmtf-rackmount1-system.json"))


def test_uefi_http_needs_http_boot_uri() -> None:
    # The recorded iDRAC and Supermicro list UefiHttp but have no Boot.HttpBootUri.
    with pytest.raises(QuirkError, match="HttpBootUri"):
        boot_override_body(STANDARD, "UefiHttp", ISO, system=load("idrac9-3.34-system-r640.json"))
    # Derived: the same System with the property ComputerSystem 1.9 added.
    system = load("idrac9-3.34-system-r640.json")
    system["Boot"]["HttpBootUri"] = None
    assert boot_override_body(STANDARD, "UefiHttp", ISO, system=system)["Boot"]["HttpBootUri"] == ISO


def test_boot_override_argument_checks() -> None:
    with pytest.raises(QuirkError, match="needs the installer's URL"):
        boot_override_body(STANDARD, "UefiHttp")
    with pytest.raises(QuirkError, match="only sent with the UefiHttp"):
        boot_override_body(STANDARD, "Cd", ISO)


def test_firmware_tuple() -> None:
    assert bmc_quirks.firmware_tuple("6.10.30.00") == (6, 10, 30, 0)
    assert bmc_quirks.firmware_tuple("TEE142M-2.41") is None
    assert bmc_quirks.firmware_tuple(None) is None


def test_virtual_media_on_is_virtual_media() -> None:
    profile = profile_for(load("idrac9-3.34-serviceroot.json"), load("idrac10-manager.json"),
                          load("idrac-system-r660-trimmed.json"))
    assert profile.virtual_media_on == profile.virtual_media == "system"
