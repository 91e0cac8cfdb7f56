# SPDX-License-Identifier: MIT
"""What BMCs do differently from DMTF's Redfish, as data: one table, `QUIRKS`.

Each row says how a BMC is recognised from what it reports about itself (the ServiceRoot's
`Vendor` and `Oem` keys, the Manager's `Model` and `FirmwareVersion`, the System's
`Manufacturer`), what differs, and the public source that says so. `profile_for` picks the first
row that matches; a BMC no row knows gets `STANDARD`, the plain DMTF path.

The helpers below turn a profile and the BMC's own JSON into what the flashing code sends: where
the virtual media slots are, the InsertMedia body, whether a slot is free, what Secure Boot
allows, the one-time boot override. Pure functions over dicts: the Redfish client (sushy) is the
caller's; tests run them on recorded responses (tests/fixtures/redfish/).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import urlsplit

Json = Mapping[str, Any]
Where = Literal["manager", "system"]

# Both properties are optional in DMTF's VirtualMedia.InsertMedia; the standard path sends them.
INSERT_PARAMETERS = ("Inserted", "WriteProtected")


class QuirkError(ValueError):
    """A step this BMC cannot take the way it was asked: the message says what and why."""


@dataclass(frozen=True)
class Quirk:
    """One row: how a BMC is recognised, what it does differently, and who says so."""

    name: str
    vendor: str  # "Dell", "Lenovo", "Supermicro": see vendor_of()
    source: str  # owner/repo#N or a documentation URL
    # Recognition beyond the vendor; None matches anything.
    manager_model: str | None = None  # a regular expression on Manager.Model
    firmware_at_least: tuple[int, ...] | None = None  # Manager.FirmwareVersion, numerically
    manager_media_suffix: str | None = None  # how Manager.VirtualMedia's link ends
    # What differs.
    virtual_media: Where = "manager"  # where its VirtualMedia collection is looked for first
    insert_refuses: frozenset[str] = frozenset()  # InsertMedia parameters it answers 400 to
    image_name_after_eject: bool = False  # ImageName stays set once the medium is ejected
    free_shows_not_connected: bool = False  # a free slot says ConnectedVia "NotConnected"
    oem_mount: bool = False  # mounts through the OEM IsoConfig (PATCH Host/Path, IsoConfig.Mount)
    notes: str = ""


@dataclass(frozen=True)
class BmcProfile:
    """How to drive the BMC at hand: the row chosen for it, and what it said about itself."""

    name: str  # the row's name, "standard" for a BMC no row knows
    detected: str  # vendor, manager model and firmware as the BMC reported them
    virtual_media: Where
    insert_refuses: frozenset[str]
    image_name_after_eject: bool
    free_shows_not_connected: bool
    oem_mount: bool
    source: str

    @property
    def virtual_media_on(self) -> Where:
        """The same as virtual_media, by the name the flashing code reads."""
        return self.virtual_media


QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        name="dell-idrac10",
        vendor="Dell",
        manager_model=r"^(1[7-9]|[2-9][0-9])G\b",  # 17G servers and later: iDRAC10, firmware 1.x
        virtual_media="system",
        source="quadsproject/badfish#579",
        notes="iDRAC10 no longer serves a VirtualMedia collection under the Manager; its firmware "
              "numbering starts again at 1.x, so the model, not the version, tells it apart",
    ),
    Quirk(
        name="dell-idrac9-6",
        vendor="Dell",
        firmware_at_least=(6, 0, 2),
        virtual_media="system",
        source="dell/terraform-provider-redfish#69",
        notes="from iDRAC9 6.00.02 InsertMedia goes to Systems/System.Embedded.1/VirtualMedia/N "
              "(also dell/terraform-provider-redfish#331, dell/iDRAC-Redfish-Scripting#265)",
    ),
    Quirk(
        name="dell-idrac",
        vendor="Dell",
        virtual_media="manager",
        source="dell/iDRAC-Redfish-Scripting#24",
        notes="iDRAC before 6.00.02: Managers/iDRAC.Embedded.1/VirtualMedia/CD; InsertMedia from 3.30",
    ),
    Quirk(
        name="lenovo-xcc",
        vendor="Lenovo",
        virtual_media="system",
        source="lenovo/python-redfish-lenovo#257",
        notes="newer XCC firmware lists virtual media under Systems/1; older firmware under the "
              "Manager, which the lookup falls back to",
    ),
    Quirk(
        name="supermicro-oem-vm1",
        vendor="Supermicro",
        manager_media_suffix="/VM1",
        virtual_media="manager",
        insert_refuses=frozenset(INSERT_PARAMETERS),
        image_name_after_eject=True,
        free_shows_not_connected=True,
        oem_mount=True,
        source="quadsproject/badfish#394",
        notes="Managers/1/VM1 with Oem.Supermicro.VirtualMediaConfig (VM1/CfgCD): PATCH Host and "
              "Path, then POST IsoConfig.Mount (quadsproject/badfish#125; Supermicro's Redfish User Guide: "
              "https://www.supermicro.com/manuals/other/redfish-user-guide-4-0/Content/"
              "general-content/virtual-media-management.htm)",
    ),
    Quirk(
        name="supermicro",
        vendor="Supermicro",
        virtual_media="manager",
        insert_refuses=frozenset(INSERT_PARAMETERS),
        image_name_after_eject=True,
        free_shows_not_connected=True,
        source="ansible-collections/community.general#4839",
        notes="InsertMedia takes Image alone; ImageName stays after EjectMedia and a free slot "
              "says ConnectedVia NotConnected (ansible-collections/community.general#6969, "
              "ansible-collections/community.general#12537)",
    ),
)

STANDARD = BmcProfile(
    name="standard",
    detected="",
    virtual_media="manager",
    insert_refuses=frozenset(),
    image_name_after_eject=False,
    free_shows_not_connected=False,
    oem_mount=False,
    source="https://www.dmtf.org/standards/redfish",
)

# What a BMC may call its maker, lower-cased, to the vendor names the table uses.
_VENDORS = {"dell": "Dell", "lenovo": "Lenovo", "supermicro": "Supermicro", "super micro": "Supermicro"}


def _canonical_vendor(text: object) -> str | None:
    if not isinstance(text, str):
        return None
    lowered = text.lower()
    for key, vendor in _VENDORS.items():
        if key in lowered:
            return vendor
    return None


def vendor_of(service_root: Json, system: Json | None = None) -> str | None:
    """The vendor as the BMC reports it: ServiceRoot.Vendor, else its Oem keys, else the
    System's Manufacturer. None when nothing names a vendor the table knows."""
    found = _canonical_vendor(service_root.get("Vendor"))
    if found:
        return found
    oem = service_root.get("Oem")
    if isinstance(oem, Mapping):
        for key in oem:
            found = _canonical_vendor(key)
            if found:
                return found
    if system is not None:
        return _canonical_vendor(system.get("Manufacturer"))
    return None


def firmware_tuple(version: object) -> tuple[int, ...] | None:
    """The leading dotted numbers of a firmware version ("6.10.30.00" -> (6, 10, 30, 0))."""
    if not isinstance(version, str):
        return None
    m = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in m.group(1).split(".")) if m else None


def _link(resource: Json | None, key: str) -> str | None:
    """The @odata.id RESOURCE[KEY] links to, if any."""
    if resource is None:
        return None
    value = resource.get(key)
    if isinstance(value, Mapping):
        target = value.get("@odata.id")
        if isinstance(target, str) and target:
            return target
    return None


def _matches(row: Quirk, vendor: str | None, manager: Json | None) -> bool:
    if row.vendor != vendor:
        return False
    manager = manager or {}
    if row.manager_model is not None:
        model = manager.get("Model")
        if not isinstance(model, str) or not re.search(row.manager_model, model):
            return False
    if row.firmware_at_least is not None:
        version = firmware_tuple(manager.get("FirmwareVersion"))
        if version is None or version < row.firmware_at_least:
            return False
    if row.manager_media_suffix is not None:
        media = _link(manager, "VirtualMedia")
        if media is None or not media.rstrip("/").endswith(row.manager_media_suffix):
            return False
    return True


def profile_for(service_root: Json, manager: Json | None, system: Json) -> BmcProfile:
    """The profile of the BMC that answered these three resources: the first row of QUIRKS it
    matches, else the standard DMTF path."""
    vendor = vendor_of(service_root, system)
    model = (manager or {}).get("Model")
    firmware = (manager or {}).get("FirmwareVersion")
    detected = " ".join(str(part) for part in (vendor or service_root.get("Vendor") or system.get("Manufacturer"),
                                                model, firmware) if part)
    for row in QUIRKS:
        if _matches(row, vendor, manager):
            return BmcProfile(
                name=row.name,
                detected=detected,
                virtual_media=row.virtual_media,
                insert_refuses=row.insert_refuses,
                image_name_after_eject=row.image_name_after_eject,
                free_shows_not_connected=row.free_shows_not_connected,
                oem_mount=row.oem_mount,
                source=row.source,
            )
    return replace(STANDARD, detected=detected)


# -- virtual media --------------------------------------------------------------------------------


def virtual_media_collections(profile: BmcProfile, manager: Json | None, system: Json) -> list[str]:
    """The VirtualMedia collections to look in, the profile's place first: the Manager's and the
    System's links, each once. Empty when neither links one."""
    by_place = {"manager": _link(manager, "VirtualMedia"), "system": _link(system, "VirtualMedia")}
    order: list[Where] = ["system", "manager"] if profile.virtual_media == "system" else ["manager", "system"]
    found: list[str] = []
    for place in order:
        path = by_place[place]
        if path and path not in found:
            found.append(path)
    return found


def virtual_media_members(profile: BmcProfile, manager: Json | None, system: Json,
                          read: Callable[[str], Json]) -> list[str]:
    """The paths of the virtual media slots: the members of the first collection (in the
    profile's order) that lists any. READ(path) returns the JSON the BMC answers for PATH."""
    collections = virtual_media_collections(profile, manager, system)
    if not collections:
        raise QuirkError("the BMC lists no VirtualMedia collection under its Manager or its System")
    for path in collections:
        members = [m.get("@odata.id") for m in read(path).get("Members", []) if isinstance(m, Mapping)]
        paths = [m for m in members if isinstance(m, str) and m]
        if paths:
            return paths
    return []


def oem_media_config(collection: Json) -> str | None:
    """The Supermicro VM1 collection's Oem.Supermicro.VirtualMediaConfig link (VM1/CfgCD)."""
    oem = collection.get("Oem")
    supermicro = oem.get("Supermicro") if isinstance(oem, Mapping) else None
    return _link(supermicro, "VirtualMediaConfig") if isinstance(supermicro, Mapping) else None


def _action_target(resource: Json, action: str) -> str | None:
    actions = resource.get("Actions")
    entry = actions.get(action) if isinstance(actions, Mapping) else None
    target = entry.get("target") if isinstance(entry, Mapping) else None
    return target if isinstance(target, str) and target else None


def insert_media_target(media: Json) -> str | None:
    """Where to POST VirtualMedia.InsertMedia for this slot, if it offers the action."""
    return _action_target(media, "#VirtualMedia.InsertMedia")


def insert_media_body(profile: BmcProfile, url: str) -> dict[str, Any]:
    """The VirtualMedia.InsertMedia body for URL, without the parameters this BMC refuses."""
    if profile.oem_mount:
        raise QuirkError(f"{profile.name} mounts through its OEM IsoConfig, not VirtualMedia.InsertMedia "
                         f"(source: {profile.source})")
    body: dict[str, Any] = {"Image": url, "Inserted": True, "WriteProtected": True}
    for name in profile.insert_refuses:
        body.pop(name, None)
    return body


def oem_mount_request(config: Json, url: str) -> tuple[dict[str, str], str]:
    """For a Supermicro IsoConfig resource (VM1/CfgCD): the PATCH body naming URL's host and path,
    and the IsoConfig.Mount target to POST to afterwards."""
    target = _action_target(config, "#IsoConfig.Mount")
    if target is None:
        raise QuirkError("the BMC's IsoConfig resource offers no IsoConfig.Mount action")
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc or not parts.path:
        raise QuirkError(f"{url!r} is not a URL with a host and a path")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return {"Host": f"{parts.scheme}://{parts.netloc}", "Path": path}, target


def slot_takes_cd(media: Json) -> bool:
    """Whether the slot can hold an ISO: MediaTypes names CD or DVD, or names nothing."""
    types = media.get("MediaTypes")
    if not isinstance(types, list) or not types:
        return True
    return "CD" in types or "DVD" in types


def slot_is_free(profile: BmcProfile, media: Json) -> bool:
    """Whether nothing is in this slot. DMTF: not Inserted and no ImageName. A BMC that keeps
    ImageName after an eject is free when it says ConnectedVia NotConnected and not Inserted."""
    inserted = media.get("Inserted") is True
    if not inserted and not media.get("ImageName"):
        return True
    return (profile.free_shows_not_connected and not inserted
            and media.get("ConnectedVia") == "NotConnected")


def free_cd_slot(profile: BmcProfile, slots: Mapping[str, Json]) -> str | None:
    """The first free slot (path -> its JSON, in the BMC's order) that takes an ISO."""
    for path, media in slots.items():
        if slot_takes_cd(media) and slot_is_free(profile, media):
            return path
    return None


# -- Secure Boot ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecureBootCapability:
    """What the BMC lets a remote caller do about the firmware's Secure Boot keys."""

    present: bool  # the System links a SecureBoot resource
    enabled: bool | None  # SecureBootEnable
    mode: str | None  # SecureBootMode: SetupMode, UserMode, AuditMode, DeployedMode
    reset_keys_target: str | None  # where to POST SecureBoot.ResetKeys
    reset_keys_values: tuple[str, ...] | None  # as listed; None: not listed (schema's, or ActionInfo's)
    reset_keys_action_info: str | None
    setup_mode_reset_type: str | None  # the ResetKeysType that leaves the firmware in setup mode
    databases: str | None  # SecureBootDatabases: certificates are enrolled into its db

    @property
    def in_setup_mode(self) -> bool:
        return self.mode == "SetupMode"

    @property
    def can_enter_setup_mode(self) -> bool:
        return self.in_setup_mode or self.setup_mode_reset_type is not None

    @property
    def can_enroll_db(self) -> bool:
        return self.databases is not None


def secure_boot_capability(system: Json, secure_boot: Json | None) -> SecureBootCapability:
    """What SYSTEM's SecureBoot resource (SECURE_BOOT, None when the System links none) allows."""
    if secure_boot is None or _link(system, "SecureBoot") is None:
        return SecureBootCapability(False, None, None, None, None, None, None, None)
    actions = secure_boot.get("Actions")
    reset = actions.get("#SecureBoot.ResetKeys") if isinstance(actions, Mapping) else None
    target = values = info = None
    if isinstance(reset, Mapping):
        target = reset.get("target") if isinstance(reset.get("target"), str) else None
        listed = reset.get("ResetKeysType@Redfish.AllowableValues")
        values = tuple(v for v in listed if isinstance(v, str)) if isinstance(listed, list) else None
        info = reset.get("@Redfish.ActionInfo") if isinstance(reset.get("@Redfish.ActionInfo"), str) else None
    setup = None
    if target is not None:
        # DeletePK alone leaves KEK and db in place; DeleteAllKeys also puts it in setup mode.
        for candidate in ("DeletePK", "DeleteAllKeys"):
            if values is None or candidate in values:
                setup = candidate
                break
    enabled = secure_boot.get("SecureBootEnable")
    mode = secure_boot.get("SecureBootMode")
    return SecureBootCapability(
        present=True,
        enabled=enabled if isinstance(enabled, bool) else None,
        mode=mode if isinstance(mode, str) else None,
        reset_keys_target=target,
        reset_keys_values=values,
        reset_keys_action_info=info,
        setup_mode_reset_type=setup,
        databases=_link(secure_boot, "SecureBootDatabases"),
    )


def db_certificates(database: Json) -> str | None:
    """The Certificates collection of a SecureBootDatabase (POST a PEM there to enroll it)."""
    path = _link(database, "Certificates")
    return path.rstrip("/") if path else None


# -- one-time boot --------------------------------------------------------------------------------


def boot_targets(system: Json) -> tuple[str, ...] | None:
    """The BootSourceOverrideTarget values the System lists, each once; None when it lists none."""
    boot = system.get("Boot")
    listed = boot.get("BootSourceOverrideTarget@Redfish.AllowableValues") if isinstance(boot, Mapping) else None
    if not isinstance(listed, list):
        return None
    return tuple(dict.fromkeys(v for v in listed if isinstance(v, str)))


def http_boot_uri_supported(system: Json) -> bool:
    """Whether the System has Boot.HttpBootUri (ComputerSystem 1.9 and later): a UefiHttp boot
    can be told its URL; without it the firmware boots whatever URL its own setup names."""
    boot = system.get("Boot")
    return isinstance(boot, Mapping) and "HttpBootUri" in boot


def boot_override_body(profile: BmcProfile, target: str, uri: str | None = None,
                       system: Json | None = None) -> dict[str, Any]:
    """The PATCH body for the System: boot TARGET once, in UEFI mode. Target, Enabled and Mode go
    in one body (some Supermicro firmware refuses a Mode set on its own). With SYSTEM, a target
    it does not list, or a URI it cannot take, is refused here, before the BMC is asked; a System
    already in UEFI mode is not sent the Mode again, as Ironic's redfish driver sets a mode only
    when it differs: a BMC may rebuild the firmware's settings on any Mode (sushy-tools' libvirt
    driver writes a new loader and variable store, without Secure Boot)."""
    if target == "UefiHttp" and uri is None:
        raise QuirkError("a UefiHttp boot needs the installer's URL")
    if uri is not None and target != "UefiHttp":
        raise QuirkError(f"a URL is only sent with the UefiHttp target, not {target}")
    if system is not None:
        listed = boot_targets(system)
        if listed is not None and target not in listed:
            raise QuirkError(f"{profile.name} BMC does not offer boot target {target} "
                             f"(it lists {', '.join(listed)})")
        if uri is not None and not http_boot_uri_supported(system):
            raise QuirkError(f"{profile.name} BMC has no Boot.HttpBootUri: its firmware cannot be "
                             f"given the URL to boot")
    boot: dict[str, Any] = {
        "BootSourceOverrideTarget": target,
        "BootSourceOverrideEnabled": "Once",
    }
    shown = system.get("Boot") if system is not None else None
    if not (isinstance(shown, Mapping) and shown.get("BootSourceOverrideMode") == "UEFI"):
        boot["BootSourceOverrideMode"] = "UEFI"
    if uri is not None:
        boot["HttpBootUri"] = uri
    return {"Boot": boot}
