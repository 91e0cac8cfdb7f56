# SPDX-License-Identifier: MIT
"""`python3 -m builder flash --bmc FLEET.toml`: install a fleet through each server's BMC (Redfish only).

For each host of the fleet file, in parallel up to --parallel: check the BMC and the system (power
state, UEFI boot mode, the plan's target disk where the BMC lists its drives), make sure the firmware
will start the appliance's installer (Secure Boot already in setup mode, put into setup mode through
`SecureBoot.ResetKeys` DeletePK, or the appliance's certificate enrolled into `SecureBootDatabases/db`),
insert the host's installer ISO as virtual media, boot it once (`Cd`, `Once`, UEFI), power-cycle,
wait until the appliance answers on its proxy as the plan's host, eject the medium and report.

A host with `boot = "http"` is booted over UEFI HTTP instead: `BootSourceOverrideTarget` `UefiHttp`
with `HttpBootUri` the installer's EFI file, `Once`, where its System allows UefiHttp and shows
HttpBootUri (checked before anything is changed on it; else refused, with what the BMC shows); no
medium is inserted or ejected. The EFI file carries no plan, and a server's firmware passes the
installer none: that path installs only where the plan reaches the installer otherwise (docs/install.md).

The medium is named, not served: `--media-url` (or the host's `media_url`) is an HTTPS URL of the
host's ISO (`builder installer --plan hosts/NAME --form iso`: each ISO carries its host's plan) on a
server the BMCs already reach and trust. A BMC pulls the image over its management network for as
long as the install takes; a server inside this process would tie every install of the rack to this
command staying up, and would need a certificate each BMC can verify, which the builder does not have.

Each host's progress is a state file (OUTPUT/state/NAME.json, written atomically after each step), so
that a run that stopped goes on where each host stands; a host whose state says installed with the
same plan and medium is reported as already installed and nothing is done or written for it. The BMC
password is read from a file only its owner can read, and lives only in this process's memory and in
sushy's session: never in argv, a progress line, the log, a state file or an error.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import logging
import os
import socket
import ssl
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from cryptography import x509

from appliance.atomic import atomic_write
from appliance.config import checks
from appliance.errors import UserError
from appliance.safe_read import loads_bounded, read_capped
from appliance.signed import install_plan
from builder import bmc_quirks, flash_report

T = TypeVar("T")
STATE_FORMAT = 1
MAX_FLEET_BYTES = 1 << 20
MAX_CREDENTIALS_BYTES = 4096
MAX_PEM_BYTES = 256 * 1024

STEP_BMC = "checking the BMC"
STEP_SYSTEM = "checking the system"
STEP_SECURE_BOOT = "preparing Secure Boot"
STEP_INSERT = "inserting the medium"
STEP_BOOT = "setting a one-time boot from the medium"
STEP_HTTP_BOOT = "setting a one-time UEFI HTTP boot"
STEP_RESET = "power-cycling"
STEP_WAIT = "waiting for the appliance"
STEP_EJECT = "ejecting the medium"
STEP_REPORT = "reporting"
# done in this order; the state file records which are done (STEP_BMC runs every time: it connects)
STEPS = (STEP_SYSTEM, STEP_SECURE_BOOT, STEP_INSERT, STEP_BOOT, STEP_RESET, STEP_WAIT, STEP_EJECT)
# boot = "http": no medium inserted or ejected, the firmware told the installer's URL
HTTP_STEPS = (STEP_SYSTEM, STEP_SECURE_BOOT, STEP_HTTP_BOOT, STEP_RESET, STEP_WAIT)

SECURE_BOOT_POLICIES = ("appliance", "as-is")
BOOTS = ("cd", "http")  # virtual media (the host's ISO), or UEFI HTTP boot of the installer's EFI file
USE_VIRTUAL_MEDIA = "use virtual media: leave out boot = \"http\" for this host and give it its ISO"


# ------------------------------------------------------------------------------ input


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password=<hidden>)"


@dataclass(frozen=True)
class Host:
    name: str
    plan_dir: Path
    bmc: str                          # https://host[:port]
    credentials: Path
    bmc_ca: Path | None = None        # PEM: the BMC's TLS verified against it (else the system's CAs)
    bmc_tls_verify: bool = True
    appliance_ca: Path | None = None  # PEM: the host's appliance CA, once known
    address: str = ""                 # where the proxy answers (host or host:port); default the plan's name
    system: str = ""                  # the ComputerSystem's path when the BMC has several
    media_url: str = ""
    secure_boot: str = "appliance"
    boot: str = "cd"                  # "http": UefiHttp with HttpBootUri, no virtual media


@dataclass(frozen=True)
class Target:
    """What the flash needs of a host's signed plan."""

    sha256: str
    proxy_name: str
    serial: str
    model: str
    min_gib: int
    max_gib: int
    report_url: str = ""  # the plan's [report] url: where its installer reports ("" without one)
    recovery_recipient: bool = False  # the plan's [report] names a recovery_recipient: a fresh install's key comes sealed


@dataclass(frozen=True)
class Job:
    host: Host
    target: Target
    media_url: str
    credentials: Credentials


HOSTS_HINT = "each host is a [[host]] table: name, plan, bmc, credentials (docs/install.md)"


def _hosts_of(doc: Any, where: str) -> list[dict[str, Any]]:
    hosts = doc.get("host") if isinstance(doc, dict) else None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) for h in hosts):
        raise UserError(f"{where}: no [[host]] tables", hint=HOSTS_HINT)
    unknown = set(doc) - {"host"}
    if unknown:
        raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}", hint="the fleet file holds [[host]] tables only (docs/install.md)")
    return hosts


HOST_KEYS = {"name", "plan", "bmc", "credentials", "bmc_ca", "bmc_tls_verify", "appliance_ca", "address", "system", "media_url",
             "secure_boot", "boot"}


def _https(url: str, where: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname or parts.username or parts.password:
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # never the credentials it holds
        raise UserError(f"{where}: {what} {shown!r} is not an https:// URL without credentials",
                        hint=f"give {what} as https://HOST[:PORT]/...; credentials go in the credentials file only")
    return url


def load_fleet(path: Path) -> list[Host]:
    """The fleet file's hosts, each value checked; paths relative to the fleet file's directory."""
    raw = read_capped(path, MAX_FLEET_BYTES, what="a fleet file", hint="name the fleet file (TOML, docs/install.md)")
    if raw is None:
        raise UserError(f"{path}: no such file", hint="name the fleet file (TOML, docs/install.md)")
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: not TOML ({e})", hint="fix the fleet file (docs/install.md)") from None
    base = path.parent
    hosts: list[Host] = []
    for i, h in enumerate(_hosts_of(doc, str(path))):
        where = f"{path}: host {i + 1}"
        unknown = set(h) - HOST_KEYS
        if unknown:
            raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}", hint="keys: " + ", ".join(sorted(HOST_KEYS)))
        for key in ("name", "plan", "bmc", "credentials"):
            if not isinstance(h.get(key), str) or not h[key]:
                raise UserError(f"{where}: {key} is missing", hint="each host needs name, plan, bmc and credentials")
        for key in HOST_KEYS - {"bmc_tls_verify"}:
            if key in h and not isinstance(h[key], str):
                raise UserError(f"{where}: {key} is not a string", hint="quote it")
        name = h["name"]
        if checks.is_host_name(name) is not None or "/" in name:
            raise UserError(f"{where}: name {name!r} is not a host name", hint="letters, digits, hyphens and dots")
        where = f"{path}: host {name}"
        verify = h.get("bmc_tls_verify", True)
        if not isinstance(verify, bool):
            raise UserError(f"{where}: bmc_tls_verify is not true or false", hint="leave it out (verify) or set it false")
        policy = h.get("secure_boot", "appliance")
        if policy not in SECURE_BOOT_POLICIES:
            raise UserError(f"{where}: secure_boot {policy!r}", hint="one of: " + ", ".join(SECURE_BOOT_POLICIES))
        boot = h.get("boot", "cd")
        if boot not in BOOTS:
            raise UserError(f"{where}: boot {boot!r}", hint="one of: " + ", ".join(BOOTS) + " (default cd: virtual media)")

        def rel(key: str, h: dict[str, Any] = h) -> Path | None:
            return (base / h[key]) if h.get(key) else None

        hosts.append(Host(
            name=name, plan_dir=base / h["plan"], bmc=_https(h["bmc"], where, "bmc").rstrip("/"),
            credentials=base / h["credentials"], bmc_ca=rel("bmc_ca"), bmc_tls_verify=verify,
            appliance_ca=rel("appliance_ca"), address=h.get("address", ""), system=h.get("system", ""),
            media_url=_https(h["media_url"], where, "media_url") if h.get("media_url") else "", secure_boot=policy, boot=boot))
    names = [h.name for h in hosts]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"{path}: host {dup} is listed twice", hint="one [[host]] table per host")
    return hosts


def read_credentials(path: Path, host: str) -> Credentials:
    """USERNAME and PASSWORD from PATH: a regular file of ours that nobody else may read (0600 or 0400),
    not reached through a link. No error shows any of its content."""
    hint = f"write it as TOML (username = \"...\", password = \"...\") and chmod 600 {path}"
    fd = flash_report.open_secret(path, f"{host}: credentials file {path}", hint, MAX_CREDENTIALS_BYTES)
    try:
        data = os.read(fd, MAX_CREDENTIALS_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        raise UserError(f"{host}: credentials file {path} is not TOML", hint=hint) from None  # its text would show the secret
    user, password = doc.get("username"), doc.get("password")
    if set(doc) != {"username", "password"} or not isinstance(user, str) or not isinstance(password, str) or not user or not password:
        raise UserError(f"{host}: credentials file {path} must hold exactly username and password (strings)", hint=hint)
    return Credentials(user, password)


def read_target(plan_dir: Path, host: str) -> Target:
    """The plan's host name and disk. Its signature is the installer's to check (against the
    release's keys, before it writes anything); here the plan must be signed and well formed."""
    hint = f"sign the host's plan: python3 -m builder plan hosts/{host}.toml"
    data = read_capped(plan_dir / install_plan.PLAN_JSON, install_plan.MAX_PLAN_BYTES, what="an install plan", hint=hint)
    sig = read_capped(plan_dir / install_plan.PLAN_SIG, install_plan.MAX_PLAN_SIG_BYTES, what="a plan's signature", hint=hint)
    if data is None or sig is None:
        raise UserError(f"{host}: no signed plan in {plan_dir} (plan.json and plan.json.sig)", hint=hint)
    try:
        doc = loads_bounded(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise UserError(f"{host}: {plan_dir / install_plan.PLAN_JSON} is not an install plan", hint=hint)
    doc.pop("signer", None)
    plan = install_plan.from_plain(doc, str(plan_dir / install_plan.PLAN_JSON))
    # the proxy's certificate names proxy.hostname, the image's when the plan has none (not the host name)
    name = plan.proxy.hostname if plan.proxy and plan.proxy.hostname else None
    if not name:
        raise UserError(f"{host}: the plan names no proxy.hostname, so the appliance cannot be recognised on its proxy "
                        "(it would answer as the image's proxy name)",
                        hint="set proxy.hostname in the plan (the name clients use) and sign it again")
    if plan.target is None:
        raise UserError(f"{host}: the plan has no [target]", hint="name the disk in the plan (docs/install.md) and sign it again")
    t = plan.target
    return Target(hashlib.sha256(data).hexdigest(), name, t.serial, t.model, t.min_size_gib, t.max_size_gib,
                  plan.report.url if plan.report else "", bool(plan.report and plan.report.recovery_recipient))


def media_url_for(host: Host, template: str) -> str:
    url = host.media_url or template.replace("{name}", host.name)
    if not url:
        raise UserError(f"{host.name}: no installer medium",
                        hint="give --media-url https://.../{name}/installer_VERSION.iso or the host's media_url")
    url = _https(url, host.name, "the medium's URL")
    if host.boot == "http" and not urlsplit(url).path.lower().endswith(".efi"):
        # an ISO loaded over HTTP becomes a RAM disk, which the installer's kernel cannot read (docs/install.md)
        raise UserError(f"{host.name}: boot = \"http\" boots the installer's EFI file, not {url}",
                        hint="give the URL of installer_VERSION.efi as the host's media_url "
                             "(made by: python3 -m builder installer --form efi)")
    return url


# ------------------------------------------------------------------------------ the BMC, through sushy


class BmcError(Exception):
    """The BMC refused or failed a request: STATUS (0: no answer) and what it said."""

    def __init__(self, status: int, answer: str) -> None:
        super().__init__(answer)
        self.status = status
        self.answer = answer


class Redfish(Protocol):
    def get(self, path: str) -> dict[str, Any]: ...
    def post(self, path: str, body: dict[str, Any]) -> None: ...
    def patch(self, path: str, body: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def bmc_answer(exc: Exception) -> str:
    """What the BMC said, from sushy's error: its @Message.ExtendedInfo messages, else the error's message."""
    info = getattr(exc, "extended_info", None)
    messages = []
    if isinstance(info, list):
        messages = [str(m.get("Message") or m.get("MessageId")) for m in info
                    if isinstance(m, dict) and (m.get("Message") or m.get("MessageId"))]
    detail = getattr(exc, "detail", None)
    status = getattr(exc, "status_code", None)
    text = "; ".join(messages) or (str(detail) if detail else "") or str(getattr(exc, "message", "") or exc)
    text = " ".join(text.split())[:300]
    return f"HTTP {status}: {text}" if status else text


class SushyRedfish:
    """Redfish through sushy's connector and session (SessionOrBasicAuth): the password stays in
    sushy's auth object and session, in memory."""

    def __init__(self, url: str, credentials: Credentials, verify: bool | str, timeout: float) -> None:
        import sushy
        from sushy import connector as sushy_connector
        from sushy import exceptions as sushy_exceptions

        self._exc = sushy_exceptions.SushyError
        wanted = {"server_side_retries": 2, "server_side_retries_delay": 1, "default_request_timeout": timeout,
                  "connect_timeout": min(timeout, 10.0)}
        known = inspect.signature(sushy_connector.Connector).parameters  # Debian 12's sushy 4.3 has fewer
        self._conn = sushy_connector.Connector(url, verify=verify, **{k: v for k, v in wanted.items() if k in known})
        try:
            self._root = sushy.Sushy(url, username=credentials.username, password=credentials.password, connector=self._conn)
        except self._exc as e:
            raise BmcError(int(getattr(e, "status_code", 0) or 0), bmc_answer(e)) from None

    @contextmanager
    def _answer(self) -> Iterator[None]:
        try:
            yield
        except self._exc as e:
            raise BmcError(int(getattr(e, "status_code", 0) or 0), bmc_answer(e)) from None
        except OSError as e:
            raise BmcError(0, str(e)) from None

    def get(self, path: str) -> dict[str, Any]:
        with self._answer():
            doc = self._conn.get(path).json()
        if not isinstance(doc, dict):
            raise BmcError(200, f"{path} is not a JSON object")
        return doc

    def post(self, path: str, body: dict[str, Any]) -> None:
        with self._answer():
            self._conn.post(path, data=body)

    def patch(self, path: str, body: dict[str, Any]) -> None:
        with self._answer():
            self._conn.patch(path, data=body)

    def close(self) -> None:
        with suppress(Exception):  # a session the BMC already dropped
            self._root._auth.close()  # ends the session on the BMC


Connect = Callable[[Host, Credentials], Redfish]


def sushy_connect(timeout: float = 30.0) -> Connect:
    def connect(host: Host, credentials: Credentials) -> Redfish:
        verify: bool | str = str(host.bmc_ca) if host.bmc_ca else host.bmc_tls_verify
        return SushyRedfish(host.bmc, credentials, verify, timeout)
    return connect


# ------------------------------------------------------------------------------ the appliance's proxy


@dataclass(frozen=True)
class Answer:
    """How the appliance's proxy answered: None when it did not (down, refused, TLS failed)."""

    status: int
    verified: bool      # its certificate chained to the host's appliance CA, for the plan's name
    names: tuple[str, ...]
    problem: str = ""   # answered, but not as the plan's host


Probe = Callable[[Host, Target], "Answer | None"]


def _names(der: bytes) -> tuple[str, ...]:
    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return (*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress)))


def _split_address(address: str, default_host: str) -> tuple[str, int]:
    if not address:
        return default_host, 443
    if address.startswith("["):
        host, _, port = address[1:].partition("]:")
        return host.rstrip("]"), int(port or 443)
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, 443


def probe_proxy(host: Host, target: Target, timeout: float = 5.0) -> Answer | None:
    """GET /health from the proxy at the host's address, TLS for the plan's name. With the host's
    appliance CA: the certificate must chain to it for that name (verified). Without one: the
    certificate must name the plan's host, and the answer says it is not verified."""
    where, port = _split_address(host.address, target.proxy_name)
    if host.appliance_ca is not None:
        ctx = ssl.create_default_context(cafile=str(host.appliance_ca))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((where, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=target.proxy_name) as tls:
            der = tls.getpeercert(binary_form=True) or b""
            tls.sendall(f"GET /health HTTP/1.1\r\nHost: {target.proxy_name}\r\nConnection: close\r\n\r\n".encode())
            head = tls.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
    except ssl.SSLCertVerificationError as e:
        return Answer(0, False, (), f"its certificate is not chained to {host.appliance_ca} for {target.proxy_name} ({e.verify_message})")
    except (OSError, ValueError):
        return None
    parts = head.split()
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return None
    names = _names(der) if der else ()
    if host.appliance_ca is None and target.proxy_name not in names:
        return Answer(int(parts[1]), False, names, f"its certificate names {', '.join(names) or 'nothing'}, not {target.proxy_name}")
    return Answer(int(parts[1]), host.appliance_ca is not None, names)


# ------------------------------------------------------------------------------ state


def state_path(output: Path, name: str) -> Path:
    return output / "state" / f"{name}.json"


def read_state(output: Path, name: str) -> dict[str, Any]:
    raw = read_capped(state_path(output, name), 1 << 20, what="a flash state file", hint="move it away to start the host afresh")
    if raw is None:
        return {}
    try:
        doc = loads_bounded(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise UserError(f"{state_path(output, name)}: not a state file of this builder", hint="move it away to start the host afresh")
    return doc


def write_state(output: Path, name: str, state: dict[str, Any]) -> None:
    atomic_write(state_path(output, name), (json.dumps(state, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)


# ------------------------------------------------------------------------------ one host


class Refusal(Exception):
    """A step that cannot go on: what is wrong, what the BMC answered, what to do."""

    def __init__(self, what: str, hint: str, answer: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint
        self.answer = answer

    def line(self, host: str, step: str) -> str:
        said = f"; the BMC answered: {self.answer}" if self.answer else ""
        return f"{host}: refused at {step}: {self.what}{said}; do: {self.hint}"


@dataclass
class Options:
    output: Path
    poll_interval: float = 10.0
    install_timeout: float = 3600.0
    media_ca: str = ""          # PEM text: the medium's server's CA, given to the BMC's virtual media
    secure_boot_cert: str = ""  # PEM text: the appliance's Secure Boot certificate (enrolled into db where allowed)
    report_listen: tuple[str, int] | None = None  # where the installers' reports are collected (builder/flash_report.py)
    report_cert: Path | None = None
    report_key: Path | None = None
    report_wait: float = 120.0  # after the proxy answers: the installer sent its report before its reboot


def _link(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key)
    return str(value.get("@odata.id", "")) if isinstance(value, dict) else ""


def _members(bmc: Redfish, path: str) -> list[str]:
    return [str(m["@odata.id"]) for m in bmc.get(path).get("Members", []) if isinstance(m, dict) and "@odata.id" in m]


def http_boot_shown(system: dict[str, Any]) -> str:
    """What the System shows against a UefiHttp boot with a URL, as the BMC shows it; "" when it allows one."""
    listed = bmc_quirks.boot_targets(system)
    if listed is not None and "UefiHttp" not in listed:
        return f"Boot lists BootSourceOverrideTarget {', '.join(listed) or 'none'}, not UefiHttp"
    if not bmc_quirks.http_boot_uri_supported(system):
        return "Boot has no HttpBootUri (the firmware cannot be given the URL)"
    return ""


def _action(doc: dict[str, Any], name: str) -> dict[str, Any]:
    actions = doc.get("Actions")
    action = actions.get(name) if isinstance(actions, dict) else None
    return action if isinstance(action, dict) else {}


class Flash:
    """One host's flash: each step once, the state saved after each."""

    def __init__(self, job: Job, bmc: Redfish, options: Options, say: Callable[[str], None], probe: Probe,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.bmc, self.options, self.say, self.probe, self.sleep, self.clock = job, bmc, options, say, probe, sleep, clock
        self.name = job.host.name
        self.state: dict[str, Any] = {}
        self.system: dict[str, Any] = {}
        self.system_path = ""
        self.manager: dict[str, Any] | None = None
        self.profile: bmc_quirks.BmcProfile | None = None

    # -------------------------------------------------------------- state

    def save(self) -> None:
        write_state(self.options.output, self.name, self.state)

    def done(self, step: str) -> bool:
        return step in self.state.get("done", [])

    def mark(self, step: str, **extra: Any) -> None:
        self.state.setdefault("done", []).append(step)
        self.state.update(extra)
        self.save()

    def call(self, what: str, hint: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except BmcError as e:
            raise Refusal(what, hint, e.answer) from None

    def get(self, path: str, what: str) -> dict[str, Any]:
        return self.call(what, "check the account's privileges", lambda: self.bmc.get(path))

    # -------------------------------------------------------------- steps

    def check_bmc(self) -> None:
        hint_sys = "name the system in the fleet file: system = \"/redfish/v1/Systems/ID\""
        root = self.call("the BMC's service root did not answer", "check the BMC's URL and that it speaks Redfish",
                         lambda: self.bmc.get("/redfish/v1/"))
        systems = _link(root, "Systems")
        if not systems:
            raise Refusal("the BMC lists no Systems collection", "this is not a server's BMC: check the URL")
        members = self.call("the BMC would not list its systems", "check the account's privileges (it needs Administrator)",
                            lambda: _members(self.bmc, systems))
        if self.job.host.system:
            if self.job.host.system not in members:
                raise Refusal(f"the BMC has no system {self.job.host.system} (it has {', '.join(members) or 'none'})", hint_sys)
            self.system_path = self.job.host.system
        elif len(members) == 1:
            self.system_path = members[0]
        else:
            raise Refusal(f"the BMC has {len(members)} systems ({', '.join(members) or 'none'})", hint_sys)
        self.system = self.call("the BMC would not show the system", "check the account's privileges",
                                lambda: self.bmc.get(self.system_path))
        links = self.system.get("Links") if isinstance(self.system.get("Links"), dict) else {}
        assert isinstance(links, dict)
        managers = [str(m.get("@odata.id", "")) for m in links.get("ManagedBy", []) if isinstance(m, dict)]
        if managers and managers[0]:
            self.manager = self.call("the BMC would not show its manager", "check the account's privileges",
                                     lambda: self.bmc.get(managers[0]))
        self.profile = bmc_quirks.profile_for(root, self.manager, self.system)

    def check_system(self) -> None:
        system = self.system
        power = str(system.get("PowerState", ""))
        if power not in ("On", "Off"):
            raise Refusal(f"the system's power state is {power or 'not shown'}", "wait until it is On or Off, then run this again")
        boot = system.get("Boot") if isinstance(system.get("Boot"), dict) else {}
        assert isinstance(boot, dict)
        mode = boot.get("BootSourceOverrideMode")
        if mode is not None and mode != "UEFI":
            raise Refusal(f"the system boots in {mode} mode, not UEFI",
                          "set the firmware to UEFI boot (the appliance boots UEFI only), then run this again")
        if self.job.host.boot == "http":
            self.check_http_boot()
        drives = self.drives()
        t = self.job.target
        if drives is None:
            self.say(f"{self.name}: the BMC lists no drives: the installer alone chooses the plan's disk")
        elif t.serial or t.model:
            match = [d for d in drives if (not t.serial or d.get("SerialNumber", "").strip() == t.serial)
                     and (not t.model or d.get("Model", "").strip() == t.model)]
            if not match:
                seen = ", ".join(f"{d.get('Model', '?')} serial {d.get('SerialNumber', '?')}" for d in drives) or "none"
                want = " ".join(x for x in (f"serial {t.serial}" if t.serial else "", f"model {t.model}" if t.model else "") if x)
                raise Refusal(f"the plan's disk ({want}) is not among the drives the BMC lists ({seen})",
                              "fix the plan's [target] and sign it again, or check the disk is in this server")
        self.mark(STEP_SYSTEM, power_before=power)

    def check_http_boot(self) -> None:
        """boot = "http": the System must allow a UefiHttp override (listed among its allowable
        targets, or none listed) and show Boot.HttpBootUri, so that the firmware can be told the
        installer's URL. Checked before anything is changed on the host."""
        shown = http_boot_shown(self.system)
        if shown:
            raise Refusal("the BMC does not allow a one-time UEFI HTTP boot with the installer's URL (boot = \"http\")",
                          USE_VIRTUAL_MEDIA, shown)

    def drives(self) -> list[dict[str, str]] | None:
        """The drives the BMC lists (Storage, else SimpleStorage), or None when it lists none."""
        found: list[dict[str, str]] = []
        try:
            storage = _link(self.system, "Storage")
            if storage:
                for s in _members(self.bmc, storage):
                    for d in self.bmc.get(s).get("Drives", []):
                        if isinstance(d, dict) and d.get("@odata.id"):
                            doc = self.bmc.get(str(d["@odata.id"]))
                            found.append({k: str(doc.get(k) or "") for k in ("SerialNumber", "Model", "CapacityBytes")})
            simple = _link(self.system, "SimpleStorage")
            if not found and simple:
                for s in _members(self.bmc, simple):
                    for d in self.bmc.get(s).get("Devices", []):
                        if isinstance(d, dict):
                            found.append({"SerialNumber": "", "Model": str(d.get("Model") or d.get("Name") or ""),
                                          "CapacityBytes": str(d.get("CapacityBytes") or "")})
        except BmcError:
            return None
        return found or None

    def secure_boot(self) -> None:
        host = self.job.host
        if host.secure_boot == "as-is":
            self.say(f"{self.name}: Secure Boot left as it is (fleet file: secure_boot = \"as-is\"): the installer enrolls in setup "
                     "mode, refuses a firmware that enforces without the appliance's certificate, installs unsealed when it is off")
            self.mark(STEP_SECURE_BOOT, secure_boot_before="left as is")
            return
        path = _link(self.system, "SecureBoot")
        sb = self.call("the BMC would not show Secure Boot", "check the account's privileges", lambda: self.bmc.get(path)) if path else None
        cap = bmc_quirks.secure_boot_capability(self.system, sb)
        if not cap.present or sb is None:
            raise Refusal("the BMC shows no SecureBoot resource, so the firmware's keys cannot be prepared through it",
                          "put the firmware into Secure Boot setup mode at its console, then set secure_boot = \"as-is\" for this host")
        before = f"{'enabled' if cap.enabled else 'disabled'}, {cap.mode or 'mode not shown'}"
        if cap.in_setup_mode:
            self.say(f"{self.name}: Secure Boot in setup mode: the installer enrolls the appliance's keys")
            self.mark(STEP_SECURE_BOOT, secure_boot_before=before)
            return
        if cap.setup_mode_reset_type and cap.reset_keys_target:
            kind, target = cap.setup_mode_reset_type, cap.reset_keys_target
            self.call(f"the BMC refused to put the firmware into setup mode (ResetKeys {kind})",
                      "put the firmware into setup mode at its console, then set secure_boot = \"as-is\"",
                      lambda: self.bmc.post(target, {"ResetKeysType": kind}))
            if not cap.enabled:
                self.call("the BMC refused to enable Secure Boot", "enable Secure Boot in the firmware setup",
                          lambda: self.bmc.patch(path, {"SecureBootEnable": True}))
            self.say(f"{self.name}: Secure Boot was {before}: ResetKeys {kind} (setup mode): the installer enrolls the appliance's keys")
            self.mark(STEP_SECURE_BOOT, secure_boot_before=before, secure_boot_action=kind)
            return
        if cap.databases and self.options.secure_boot_cert and cap.enabled:
            certs = self.db_certificates(cap.databases)
            if certs:
                self.call("the BMC refused the appliance's certificate in db",
                          "enroll the appliance's certificate at the firmware's console, or put it into setup mode",
                          lambda: self.bmc.post(certs, {"CertificateString": self.options.secure_boot_cert, "CertificateType": "PEM"}))
                self.say(f"{self.name}: Secure Boot {before}: the appliance's certificate enrolled into db")
                self.mark(STEP_SECURE_BOOT, secure_boot_before=before, secure_boot_action="db enrolled")
                return
        offered = ", ".join(cap.reset_keys_values) if cap.reset_keys_values is not None else (
            "not listed" if cap.reset_keys_target else "no ResetKeys action")
        why = "" if cap.enabled else " (off: the appliance would boot unsealed)"
        more = "" if self.options.secure_boot_cert or not cap.databases else "; or give --secure-boot-cert to enroll it into db"
        raise Refusal(f"Secure Boot is {before}{why} and the BMC offers no way into setup mode (ResetKeys: {offered})"
                      + ("" if cap.databases else " nor SecureBootDatabases"),
                      "put the firmware into Secure Boot setup mode at its console, then set secure_boot = \"as-is\" for this host" + more)

    def db_certificates(self, databases: str) -> str:
        members = self.call("the BMC would not list its Secure Boot databases", "check the account's privileges",
                            lambda: _members(self.bmc, databases))
        for member in [m for m in members if m.rstrip("/").endswith("/db")]:  # DMTF names it db (SecureBootDatabase.DatabaseId)
            db = self.get(member, "the BMC would not show its Secure Boot db")
            if db.get("DatabaseId", "db") == "db":
                return bmc_quirks.db_certificates(db) or ""
        return ""

    def slot(self) -> dict[str, Any]:
        """The CD/DVD virtual media slot, where this BMC keeps it."""
        assert self.profile is not None
        profile = self.profile
        slot_path = self.state.get("slot", "")
        if slot_path:
            return self.get(slot_path, "the BMC would not show the virtual media slot")
        try:
            members = self.call("the BMC would not list its virtual media", "check the account's privileges",
                                lambda: bmc_quirks.virtual_media_members(profile, self.manager, self.system, self.bmc.get))
        except bmc_quirks.QuirkError as e:
            raise Refusal(str(e), "enable virtual media on the BMC (a licence, on some), then run this again") from None
        slots = {m: self.get(m, "the BMC would not show a virtual media slot") for m in members}
        url = self.job.media_url
        ours = next((p for p, d in slots.items() if bmc_quirks.slot_takes_cd(d) and d.get("Image") == url), None)
        chosen = ours or bmc_quirks.free_cd_slot(profile, slots)
        if chosen is None:
            held = ", ".join(f"{p} holds {d.get('Image') or d.get('ImageName')}" for p, d in slots.items() if bmc_quirks.slot_takes_cd(d))
            raise Refusal(f"no free CD/DVD virtual media slot ({held or 'none takes an ISO'})",
                          "eject what is inserted (the BMC's virtual media page) if nothing needs it, then run this again")
        self.state["slot"] = chosen
        return slots[chosen]

    def insert(self) -> None:
        assert self.profile is not None
        url = self.job.media_url
        slot = self.slot()
        path = self.state["slot"]
        if slot.get("Image") == url and slot.get("Inserted", True):
            self.mark(STEP_INSERT)
            return
        if not bmc_quirks.slot_is_free(self.profile, slot):
            raise Refusal(f"the CD slot {path} holds {slot.get('Image') or slot.get('ImageName')}",
                          "eject it (the BMC's virtual media page) if nothing needs it, then run this again")
        if self.profile.oem_mount:
            self.oem_mount(url)
            self.mark(STEP_INSERT)
            return
        if self.options.media_ca:
            certs = _link(slot, "Certificates")
            if "VerifyCertificate" not in slot or not certs:
                raise Refusal("the BMC cannot be given the medium's CA (no VerifyCertificate or Certificates on its virtual media)",
                              "leave out --media-ca for BMCs that cannot verify the medium's server (the installer checks every signature)")
            if not self.holds_certificate(certs, self.options.media_ca):  # a run before this one may have given it
                self.call("the BMC refused the medium's CA", "check the CA (PEM) given with --media-ca, or remove the slot's certificate",
                          lambda: self.bmc.post(certs, {"CertificateString": self.options.media_ca, "CertificateType": "PEM"}))
            self.call("the BMC refused to verify the medium's certificate", "leave out --media-ca for this BMC",
                      lambda: self.bmc.patch(path, {"VerifyCertificate": True}))
        elif slot.get("VerifyCertificate") is False:
            self.say(f"{self.name}: the BMC does not verify the medium's server (VerifyCertificate false): give --media-ca to make it")
        target = bmc_quirks.insert_media_target(slot) or f"{path}/Actions/VirtualMedia.InsertMedia"
        body = bmc_quirks.insert_media_body(self.profile, url)
        self.call(f"the BMC refused to insert {url}", "check the BMC reaches the medium's server and trusts its certificate",
                  lambda: self.bmc.post(target, body))
        after = self.call("the BMC would not show the slot after inserting", "check the BMC", lambda: self.bmc.get(path))
        if after.get("Image") != url or after.get("Inserted") is False:
            raise Refusal(f"the slot shows {after.get('Image') or 'nothing'} after inserting {url}",
                          "check the medium's URL from the BMC's network")
        self.mark(STEP_INSERT)

    def holds_certificate(self, collection: str, pem: str) -> bool:
        def norm(text: object) -> str:
            return "".join(str(text).split())
        for member in self.call("the BMC would not list the slot's certificates", "check the account's privileges",
                                lambda: _members(self.bmc, collection)):
            if norm(self.get(member, "the BMC would not show a certificate").get("CertificateString")) == norm(pem):
                return True
        return False

    def oem_mount(self, url: str) -> None:
        """Supermicro's OEM mount: PATCH the IsoConfig resource with the URL's host and path, then POST IsoConfig.Mount."""
        assert self.profile is not None
        profile = self.profile
        collections = bmc_quirks.virtual_media_collections(profile, self.manager, self.system)
        config_path = next((c for c in (bmc_quirks.oem_media_config(self.bmc.get(p)) for p in collections) if c), None)
        if config_path is None:
            raise Refusal("the BMC wants its OEM IsoConfig mount but links no VirtualMediaConfig", "mount the ISO on the BMC's web page")
        config = self.call("the BMC would not show its IsoConfig", "check the account's privileges", lambda: self.bmc.get(config_path))
        try:
            body, target = bmc_quirks.oem_mount_request(config, url)
        except bmc_quirks.QuirkError as e:
            raise Refusal(str(e), "mount the ISO on the BMC's web page") from None
        self.call("the BMC refused the ISO's host and path (IsoConfig)", "check the medium's URL",
                  lambda: self.bmc.patch(config_path, body))
        self.call("the BMC refused to mount the ISO (IsoConfig.Mount)", "mount the ISO on the BMC's web page",
                  lambda: self.bmc.post(target, {}))

    def boot_once(self) -> None:
        assert self.profile is not None
        if self.job.host.boot == "http":
            self.http_boot_once()
            return
        try:
            body = bmc_quirks.boot_override_body(self.profile, "Cd", system=self.system)
        except bmc_quirks.QuirkError as e:
            raise Refusal(str(e), "boot the medium once from the BMC's console") from None
        self.call("the BMC refused the one-time boot from the medium", "choose the virtual CD once in the BMC's boot menu",
                  lambda: self.bmc.patch(self.system_path, body))
        self.mark(STEP_BOOT)

    def http_boot_once(self) -> None:
        """UefiHttp once, in UEFI mode, with HttpBootUri the installer's EFI file: no medium is inserted."""
        assert self.profile is not None
        url = self.job.media_url
        try:
            body = bmc_quirks.boot_override_body(self.profile, "UefiHttp", url, system=self.system)
        except bmc_quirks.QuirkError as e:
            raise Refusal(str(e), USE_VIRTUAL_MEDIA, http_boot_shown(self.system)) from None
        self.say(f"{self.name}: the installer's EFI file carries no plan and a server's firmware passes it none: it installs only "
                 "where the plan reaches it otherwise (docs/install.md, \"A plain HTTPS boot server\")")
        if self.options.media_ca:
            self.say(f"{self.name}: --media-ca is given to virtual media only: the firmware must trust the server of {url} "
                     "itself (its own setup)")
        self.call(f"the BMC refused the one-time UEFI HTTP boot from {url}", USE_VIRTUAL_MEDIA,
                  lambda: self.bmc.patch(self.system_path, body))
        self.mark(STEP_HTTP_BOOT, http_boot_uri=url)

    def power_cycle(self) -> None:
        system = self.call("the BMC would not show the system", "check the BMC", lambda: self.bmc.get(self.system_path))
        reset = _action(system, "#ComputerSystem.Reset")
        target = str(reset.get("target") or f"{self.system_path}/Actions/ComputerSystem.Reset")
        allowed = reset.get("ResetType@Redfish.AllowableValues")
        wanted = ("On",) if system.get("PowerState") == "Off" else ("ForceRestart", "PowerCycle")
        kind = next((k for k in wanted if not isinstance(allowed, list) or k in allowed), None)
        if kind is None:
            raise Refusal(f"the BMC offers none of {', '.join(wanted)} (it offers {', '.join(map(str, allowed or []))})",
                          "power-cycle the server by hand; this run then goes on")
        self.call(f"the BMC refused the reset ({kind})", "power-cycle the server by hand, then run this again",
                  lambda: self.bmc.post(target, {"ResetType": kind}))
        self.mark(STEP_RESET, reset=kind, reset_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))

    def wait(self) -> None:
        """Until the proxy answers as the plan's host, after it was seen down once (a running
        appliance answers before the reset takes hold)."""
        started = self.clock()
        while True:
            answer = self.probe(self.job.host, self.job.target)
            if answer is None and not self.state.get("seen_down"):
                self.state["seen_down"] = True
                self.save()
            elif answer is not None and self.state.get("seen_down"):
                if answer.problem:
                    raise Refusal(f"the appliance answers, but {answer.problem}",
                                  "a wiped disk makes a new CA at first boot: read its fingerprint on the console (tty1) "
                                  "and update appliance_ca")
                report = self.collect_report()
                self.mark(STEP_WAIT, proxy={"health": answer.status, "verified": answer.verified, "names": list(answer.names)},
                          report=report)
                return
            if self.clock() - started > self.options.install_timeout:
                raise Refusal(f"the appliance did not answer on its proxy as {self.job.target.proxy_name} within "
                              f"{self.options.install_timeout:.0f} s", "look at the server's console through the BMC; "
                              "run this again to keep waiting (the host goes on from here)")
            self.sleep(self.options.poll_interval)

    def collect_report(self) -> str:
        """The path of the installer's report for this host's plan ("" when none arrived), looked for
        up to report_wait when this run collects reports (else once: a stopped run may have one).
        Refusal when it contradicts the plan: another disk than the plan's serial, or another plan."""
        t = self.job.target
        if not t.report_url:
            return ""
        path = flash_report.report_path(self.options.output, self.name)
        deadline = self.clock() + (self.options.report_wait if self.options.report_listen is not None else 0.0)
        while True:
            try:
                doc = flash_report.read_report(self.options.output, self.name)
            except UserError as e:
                raise Refusal(e.message, e.hint) from None
            if doc is not None and doc["plan_sha256"] == t.sha256:
                break
            if self.clock() >= deadline:
                if doc is None:
                    return ""
                raise Refusal(f"the installer's report {path} is for another plan (SHA-256 {doc['plan_sha256'][:16]}..., "
                              f"this host's is {t.sha256[:16]}...)",
                              f"move {path} away if it is an older install's, then run this again")
            self.sleep(min(max(self.options.poll_interval, 0.05), 2.0))
        serial = doc["disk"]["serial"].strip()
        if t.serial and serial != t.serial:
            raise Refusal(f"its installer reports it wrote {doc['disk']['path']} serial {serial or '(none)'}, "
                          f"not the plan's disk (serial {t.serial})",
                          f"look at the server's console and at {path}; if the plan names the wrong disk, fix its [target] "
                          "and sign it again")
        return str(path)

    def eject(self) -> None:
        assert self.profile is not None
        slot = self.slot()
        path = self.state["slot"]
        if not bmc_quirks.slot_is_free(self.profile, slot):
            target = str(_action(slot, "#VirtualMedia.EjectMedia").get("target") or f"{path}/Actions/VirtualMedia.EjectMedia")
            self.call("the BMC refused to eject the medium", "eject it on the BMC's virtual media page",
                      lambda: self.bmc.post(target, {}))
            after = self.call("the BMC would not show the slot after ejecting", "check the BMC", lambda: self.bmc.get(path))
            if not bmc_quirks.slot_is_free(self.profile, after):
                raise Refusal(f"the slot still holds {after.get('Image')} after ejecting", "eject it on the BMC's virtual media page")
        self.mark(STEP_EJECT)

    def report(self) -> str:
        proxy = self.state.get("proxy", {})
        trust = ("certificate chained to its appliance CA" if proxy.get("verified")
                 else "certificate NOT verified: no appliance_ca for it in the fleet file")
        sb_after = "not shown"
        path = _link(self.system, "SecureBoot")
        if path:
            try:
                sb = self.bmc.get(path)
                sb_after = f"{'enabled' if sb.get('SecureBootEnable') else 'disabled'}, {sb.get('SecureBootMode') or 'mode not shown'}"
            except BmcError as e:
                sb_after = f"not shown ({e.answer})"
        line = (f"installed: answers on its proxy as {self.job.target.proxy_name} (/health {proxy.get('health')}, {trust}); "
                f"Secure Boot at the BMC: {sb_after}; {self.installer_said()}")
        self.state.update(status="installed", summary=line, secure_boot_after=sb_after)
        self.save()
        return line

    def installer_said(self) -> str:
        """What the installer wrote, from its report; else where its summary is."""
        doc = None
        if self.state.get("report"):
            with suppress(UserError):
                doc = flash_report.read_report(self.options.output, self.name)
        if doc is not None:
            disk = doc["disk"]
            ek = flash_report.ek_fingerprint(doc)
            path = flash_report.report_path(self.options.output, self.name)
            return (f"the installer wrote appliance {doc['version']} on {disk['path']} ({disk['model'] or '-'}, serial "
                    f"{disk['serial'] or '-'}, {disk['size_bytes'] / (1 << 30):.1f} GiB), /usr {doc['usr_hash'][:16]}..., "
                    f"{doc['secure_boot'] or 'secure boot not said'}, " + (f"TPM EK {ek}" if ek else "TPM EK not enrolled")
                    + f" (its report: {path})" + self.recovery_said(doc, path))
        if self.job.target.report_url:
            return f"no report from its installer arrived at {self.job.target.report_url} (its console shows its summary)"
        return "the installer's own summary is on its console only (docs/install.md)"

    def recovery_said(self, doc: dict[str, Any], path: Path) -> str:
        """Where /var's recovery key is, after the report's own words ("" when its plan seals none)."""
        if flash_report.SEALED_KEY in doc:
            return (f"; recovery key sealed to the plan's recipient in {path} "
                    f"(python3 -m builder recovery-key open --key RECOVERY.key {path})")
        if not self.job.target.recovery_recipient:
            return ""
        if doc["reinstalled"]:
            return "; no recovery key in its report: a re-install makes none (the first install's key still opens /var)"
        return "; no recovery key in its report although its plan names a recipient: read it on its console (tty1)"

    def run(self) -> str:
        """Every step not done yet; the host's summary line. Raises Refusal."""
        steps: list[tuple[str, Callable[[], None]]] = [
            (STEP_SYSTEM, self.check_system), (STEP_SECURE_BOOT, self.secure_boot), (STEP_INSERT, self.insert),
            (STEP_BOOT, self.boot_once), (STEP_RESET, self.power_cycle), (STEP_WAIT, self.wait), (STEP_EJECT, self.eject)]
        if self.job.host.boot == "http":
            steps = [(STEP_HTTP_BOOT, self.boot_once) if step == STEP_BOOT else (step, fn) for step, fn in steps
                     if step in HTTP_STEPS or step == STEP_BOOT]
        for step, fn in steps:
            if self.done(step):
                continue
            self.state["step"] = step
            self.say(f"{self.name}: {step}")
            fn()
        self.state["step"] = STEP_REPORT
        return self.report()


# ------------------------------------------------------------------------------ the fleet


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str   # installed, already installed, failed
    line: str


class Progress:
    """One line per host per step, on stdout and in OUTPUT/flash.log; the password never reaches either
    (it is never formatted into a line: tests search both)."""

    def __init__(self, log: Path, echo: Callable[[str], None] = print) -> None:
        self.lock = threading.Lock()
        self.log = log
        self.echo = echo

    def __call__(self, line: str) -> None:
        with self.lock:
            self.echo(line)
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} {line}\n")


def flash_host(job: Job, options: Options, say: Callable[[str], None], connect: Connect, probe: Probe) -> Outcome:
    name = job.host.name
    state = read_state(options.output, name)
    if state and (state.get("plan_sha256") != job.target.sha256 or state.get("media_url") != job.media_url
                  or state.get("boot", "cd") != job.host.boot):
        say(f"{name}: the plan, the medium or the boot changed since the last run: starting this host afresh")
        state = {}
    if state.get("status") == "installed":
        line = f"already installed with this plan (state {state_path(options.output, name)}): nothing done"
        say(f"{name}: {line}")
        return Outcome(name, "already installed", line)
    if job.target.report_url and options.report_listen is None:
        say(f"{name}: its installer's report will not be collected (give --report-listen, --report-cert and --report-key "
            f"for its plan's report.url {job.target.report_url})")
    if not state:
        state = {"format": STATE_FORMAT, "host": name, "plan_sha256": job.target.sha256, "media_url": job.media_url,
                 "boot": job.host.boot, "done": []}
    elif state.get("done"):
        say(f"{name}: resuming after {state['done'][-1]}")
    state.update(status="running", step=STEP_BMC)
    step = STEP_BMC
    flash: Flash | None = None
    try:
        say(f"{name}: {STEP_BMC}")
        try:
            bmc = connect(job.host, job.credentials)
        except BmcError as e:
            raise Refusal(f"could not log in to {job.host.bmc}", "check the BMC's URL, its CA (bmc_ca) and the credentials file",
                          e.answer) from None
        try:
            flash = Flash(job, bmc, options, say, probe)
            flash.state = state
            flash.check_bmc()
            assert flash.profile is not None
            say(f"{name}: BMC {flash.profile.name}, system {flash.system_path}")
            line = flash.run()
        finally:
            bmc.close()
    except Refusal as r:
        step = flash.state.get("step", STEP_BMC) if flash is not None else step
        state.update(status="failed", failed_step=step, reason=r.line(name, step))
        write_state(options.output, name, state)
        say(r.line(name, step))
        return Outcome(name, "failed", r.line(name, step))
    except Exception as e:  # one host's fault stops only that host
        step = state.get("step", STEP_BMC)
        what = f"{name}: failed at {step}: {type(e).__name__}: {e}"
        state.update(status="failed", failed_step=step, reason=what)
        write_state(options.output, name, state)
        say(what)
        return Outcome(name, "failed", what)
    say(f"{name}: {line}")
    return Outcome(name, "installed", line)


def prepare(fleet: Path, media_url: str) -> list[Job]:
    """Every host's job, or a UserError (exit 2) before any BMC is asked anything."""
    jobs = []
    for host in load_fleet(fleet):
        for pem in (host.bmc_ca, host.appliance_ca):
            if pem is not None and not pem.is_file():
                raise UserError(f"{host.name}: {pem}: no such file", hint="give a PEM file's path, relative to the fleet file")
        target = read_target(host.plan_dir, host.name)
        jobs.append(Job(host, target, media_url_for(host, media_url), read_credentials(host.credentials, host.name)))
    return jobs


@contextmanager
def sushy_log(path: Path) -> Iterator[None]:
    """sushy's own log (requests, responses, sessions; it masks passwords itself) into PATH."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("sushy")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        handler.close()


def collector(jobs: list[Job], options: Options, say: Callable[[str], None]) -> AbstractContextManager[object]:
    """The installers' reports collected for the hosts whose plan has [report] (--report-listen), else nothing."""
    if options.report_listen is None or options.report_cert is None or options.report_key is None:
        return nullcontext()
    reporting = [j for j in jobs if j.target.report_url]
    shared = next((j for j in reporting if [k.target.sha256 for k in reporting].count(j.target.sha256) > 1), None)
    if shared is not None:
        raise UserError(f"{shared.host.name}: its plan is another host's too, so their installers' reports cannot be told apart",
                        hint="give each host its own plan (builder plan), as the installer needs anyway")
    return flash_report.Collector(options.report_listen, options.report_cert, options.report_key,
                                  {j.target.sha256: j.host.name for j in reporting}, options.output, say,
                                  hosts={j.host.name: j.target.proxy_name for j in reporting})


def flash_fleet(fleet: Path, media_url: str, options: Options, parallel: int = 4, connect: Connect | None = None,
                probe: Probe = probe_proxy, echo: Callable[[str], None] = print) -> int:
    """Flash every host of FLEET; exit status 0 all installed, 1 a host failed (UserError: 2)."""
    if parallel < 1:
        raise UserError(f"--parallel {parallel}", hint="give 1 or more")
    jobs = prepare(fleet, media_url)
    options.output.mkdir(parents=True, exist_ok=True)
    os.chmod(options.output, 0o700)
    say = Progress(options.output / "flash.log", echo)
    connect = connect or sushy_connect()
    with sushy_log(options.output / "sushy.log"), collector(jobs, options, say), \
            ThreadPoolExecutor(max_workers=min(parallel, len(jobs))) as pool:
        outcomes = list(pool.map(lambda j: flash_host(j, options, say, connect, probe), jobs))
    width = max(len(o.name) for o in outcomes)
    say("summary:")
    for o in outcomes:
        say(f"  {o.name:<{width}}  {o.status:<17}  {o.line.removeprefix(o.name + ': ').removeprefix(o.status + ': ')}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


# ------------------------------------------------------------------------------ CLI glue


def _read_pem(path: str, what: str) -> str:
    raw = read_capped(Path(path), MAX_PEM_BYTES, what=what, hint="give a PEM file")
    if raw is None or b"-----BEGIN CERTIFICATE-----" not in raw:
        raise UserError(f"{path}: not a PEM certificate ({what})", hint="give a PEM file")
    return raw.decode("ascii", "replace")


def listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) as --report-listen takes it."""
    host, sep, port = (text[1:].partition("]:") if text.startswith("[") else text.rpartition(":"))
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or (":" in host and not text.startswith("[")):
        raise UserError(f"--report-listen {text!r} is not HOST:PORT",
                        hint="give the address and port the plans' report.url name, e.g. --report-listen 10.0.0.5:8443")
    return host, int(port)


def report_options(args: argparse.Namespace) -> dict[str, Any]:
    """--report-listen, --report-cert and --report-key: all three or none."""
    given = [args.report_listen, args.report_cert, args.report_key]
    if not any(given):
        return {}
    if not all(given):
        raise UserError("--report-listen, --report-cert and --report-key go together",
                        hint="give all three to collect the installers' reports (docs/install.md), or none")
    return {"report_listen": listen_address(args.report_listen), "report_cert": Path(args.report_cert),
            "report_key": Path(args.report_key)}


def cmd_flash_bmc(args: argparse.Namespace) -> int:
    from builder import build

    fleet = Path(args.bmc)
    output = Path(args.output) if args.output else build.ROOT / "out" / "flash" / fleet.stem
    options = Options(output=output, poll_interval=args.poll_interval, install_timeout=args.install_timeout,
                      media_ca=_read_pem(args.media_ca, "the medium's CA") if args.media_ca else "",
                      secure_boot_cert=(_read_pem(args.secure_boot_cert, "the appliance's Secure Boot certificate")
                                        if args.secure_boot_cert else ""), **report_options(args))
    return flash_fleet(fleet, args.media_url or "", options, args.parallel)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`flash`'s options for --bmc."""
    g = p.add_argument_group("through the BMCs (--bmc FLEET.toml; docs/install.md, \"Flashing through the BMCs\")")
    g.add_argument("--bmc", metavar="FLEET.toml", help="install every host of this fleet file through its BMC (Redfish)")
    g.add_argument("--media-url", metavar="URL",
                   help="the installer ISO's https:// URL (a boot = \"http\" host's: the EFI file's), {name} replaced by each "
                        "host's name (a host's media_url wins)")
    g.add_argument("--media-ca", metavar="PEM", help="the medium's server's CA, given to each BMC's virtual media to verify it")
    g.add_argument("--secure-boot-cert", metavar="PEM",
                   help="the appliance's Secure Boot certificate, enrolled into db where a BMC allows that but not setup mode")
    g.add_argument("--parallel", type=int, default=4, metavar="N", help="hosts at once (default 4)")
    g.add_argument("--output", metavar="DIR", help="state files and logs (default: out/flash/FLEET)")
    g.add_argument("--poll-interval", type=float, default=10.0, metavar="S", help="seconds between looks at the appliance (default 10)")
    g.add_argument("--install-timeout", type=float, default=3600.0, metavar="S",
                   help="how long to wait for each appliance after its reset (default 3600)")
    g.add_argument("--report-listen", metavar="HOST:PORT",
                   help="collect each installer's report (its plan's [report]) over HTTPS on this address, which the plans' "
                        "report.url names; with --report-cert and --report-key")
    g.add_argument("--report-cert", metavar="PEM", help="the collector's certificate, signed by the plans' report.ca (or that CA itself)")
    g.add_argument("--report-key", metavar="PEM", help="the collector's private key: a file of yours, mode 0600")


EXAMPLES = ["python3 -m builder flash --bmc fleet.toml --media-url 'https://media.example.net/{name}/installer_1.4.0.iso'"]
EXIT_CODES = [(0, "every host is installed (or was already)"), (1, "some host failed (its line says where and what to do)"),
              (2, "bad input: the fleet file, a plan, a credentials file (one line and a hint)")]
