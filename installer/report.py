# SPDX-License-Identifier: MIT
"""The installer's report: what it wrote, sent to the collector of `builder flash --bmc` when the
signed plan has a [report] section, so that the summary reaches an operator nobody put at the console.

The report is the summary's facts as JSON and the summary's text, both without the recovery key
(shown on the console once, it travels nowhere in the clear). When the plan's report names a
`recovery_recipient` and the install made a recovery key, the report carries that key sealed to the
recipient (appliance/recovery_seal.py, bound to the report's host and plan), which only the holder of
the matching private key opens (`builder recovery-key open`). It goes by one HTTPS POST to the plan's
`report.url`, to a server that proves itself with the certificate or CA of the plan's `report.ca`:
that CA is the connection's only trust, so the summary goes to the operator's collector and nowhere
else. A report that cannot be sent fails no install: one line on the console says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from appliance import recovery_seal
from appliance.signed import install_plan, release_manifest
from installer import remote, select

REPORT_FORMAT = 1
MAX_REPORT_BYTES = 64 * 1024  # the collector reads none larger
WAIT_ONLINE_S = 60
PAUSE_S = 5.0
CONTENT_TYPE = "application/json"


def host_name(plan: install_plan.Plan) -> str:
    """The name the appliance answers as on its proxy, as `builder flash --bmc` reads it from the plan
    (which it refuses without proxy.hostname); else the host name, for the record."""
    return (plan.proxy.hostname if plan.proxy and plan.proxy.hostname else "") or plan.hostname or ""


def document(choice: select.Choice, payload: Any, plan: install_plan.Plan, plan_json: bytes, steps: Sequence[str],
             seconds: float, secure_boot: str, attestation: Sequence[str], summary: str) -> dict[str, Any]:
    """The report (JSON-safe). PAYLOAD is the install's Payload; PLAN_JSON the plan's bytes as signed;
    SUMMARY the console's summary rendered without the recovery key."""
    disk = choice.disk
    return {
        "format": REPORT_FORMAT,
        "host": host_name(plan),
        "plan_sha256": hashlib.sha256(plan_json).hexdigest(),
        "version": payload.version,
        "reinstalled": choice.installed,
        "disk": {"path": disk.path, "model": disk.model, "serial": disk.serial, "size_bytes": int(disk.size)},
        "usr_hash": payload.usrhash,
        "secure_boot": secure_boot,
        "attestation": [line.strip() for line in attestation],
        "steps": list(steps),
        "seconds": int(seconds),
        "summary": summary,
    }


def seal_recovery_key(doc: dict[str, Any], recipient: str, recovery: str) -> str:
    """DOC with the recovery key RECOVERY sealed to RECIPIENT (PEM) as `recovery_key_sealed`, bound to
    DOC's host and plan_sha256: "" then, else the console's line saying why it is not (a report
    without it still goes: the console shows the key)."""
    try:
        doc["recovery_key_sealed"] = recovery_seal.seal(recipient, recovery.encode("ascii"),
                                                        recovery_seal.report_context(doc["host"], doc["plan_sha256"]))
    except (ValueError, UnicodeEncodeError) as e:
        return f"recovery key NOT sealed into the report ({str(e)[:200]}): write it down from the summary above"
    return ""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a new address: the report goes to the plan's URL only."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def tls_context(ca: str) -> ssl.SSLContext:
    """Trust only CA (PEM text, the plan's report.ca), the host name checked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies and checks the host name; no system CA loaded
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=ca)
    return ctx


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"the collector answered HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        e = e.reason if isinstance(e.reason, BaseException) else e
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"its certificate is not the plan's report.ca's ({e.verify_message})"
    text = " ".join(str(e).split())[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def send(settings: install_plan.Report, doc: dict[str, Any], *, timeout: float = 10.0, tries: int = 3,
         sleep: Callable[[float], None] = time.sleep, wait_online: Callable[[int], None] = remote.wait_online) -> str:
    """POST DOC (canonical JSON) to SETTINGS.url, trusting SETTINGS.ca only; TRIES attempts with a
    pause between. The console's one line; never raises (a report that cannot be sent fails no install)."""
    url = settings.url
    lost = "; the summary above is the only copy"
    try:
        body = release_manifest.canonical(doc)
        if len(body) > MAX_REPORT_BYTES:
            return f"report NOT sent to {url}: {len(body)} bytes, more than the collector reads ({MAX_REPORT_BYTES}){lost}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect(),
                                             urllib.request.HTTPSHandler(context=tls_context(settings.ca)))
    except Exception as e:  # a CA the plan's check let through but OpenSSL refuses: no report, still the install
        return f"report NOT sent to {url}: {_reason(e)}{lost}"
    with contextlib.suppress(Exception):  # only DHCP's time: the POST's own error says what is wrong
        wait_online(WAIT_ONLINE_S)
    reason = "not tried"
    for attempt in range(max(1, tries)):
        if attempt:
            sleep(PAUSE_S)
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": CONTENT_TYPE})
        try:
            with opener.open(request, timeout=timeout) as answer:
                status = int(answer.status)
            if 200 <= status < 300:
                return f"report sent to {url} (HTTP {status})"
            reason = f"the collector answered HTTP {status}"
        except urllib.error.HTTPError as e:
            reason = _reason(e)
            if 400 <= e.code < 500 and e.code not in (408, 429):
                break  # the collector refused this report: the same one again would be refused too
        except Exception as e:  # whatever the network does, the install is done
            reason = _reason(e)
    return f"report NOT sent to {url}: {reason}{lost}"
