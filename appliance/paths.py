# SPDX-License-Identifier: MIT
"""Where things are on the device: one place for every path and unit name.

Each can be moved for tests with an environment variable of the same name prefixed APPLIANCE_
(e.g. APPLIANCE_RUN_DIR), so tests run the real code against a temporary tree.
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(name: str, default: str) -> Path:
    return Path(os.environ.get(f"APPLIANCE_{name}", default))


# Read-only, in the verity-protected /usr
LIB_DIR = _path("LIB_DIR", "/usr/lib/appliance")
CONFIG_JSON = LIB_DIR / "appliance.json"  # Config.to_json() of the build
MANIFEST = LIB_DIR / "manifest.json"  # the signed release manifest
MANIFEST_SIG = LIB_DIR / "manifest.json.sig"  # detached Ed25519 signature
TRUSTED_KEYS_DIR = LIB_DIR / "keys"  # *.pub: the public keys this version trusts
TIMESTAMP_KEYS_DIR = LIB_DIR / "timestamp-keys"  # *.pub: the keys whose update timestamps it trusts (not release keys)
ENGINE_FILES_DIR = LIB_DIR / "engine"  # overlays/ and tuning/ as bind-mounted into the engine
FACTORY_ETC_RECORD = LIB_DIR / "factory-etc.json"  # the image's /etc at build (appliance.factory_etc)
# the first-boot definitions of engine slot B (builder/render.py first_boot_repart): the installer
# reads their sizes, which are the configuration's, to know how large a disk must be
ENGINE_B_REPART = ("25-engine-b.conf", "26-engine-b-verity.conf")

# Outside the signed image: compared with the factory /etc by `applianctl verify`
ETC_DIR = _path("ETC_DIR", "/etc")
RUN_ROOT = _path("RUN_ROOT", "/run")  # where runtime units take effect (systemd/system, containers/systemd)

# Runtime state (tmpfs): one JSON file per check, each {"ok": bool, "reason": str, ...}
RUN_DIR = _path("RUN_DIR", "/run/appliance")
STARTUP_REPORT = RUN_DIR / "startup-report.json"
SHM_CHECK = RUN_DIR / "shm-check.json"
VERIFY_RESULT = RUN_DIR / "verify.json"
PREFLIGHT_RESULT = RUN_DIR / "preflight.json"
GPU_SELFTEST = RUN_DIR / "gpu-selftest.json"  # this boot's GPU self-test (appliance-gpu-selftest.service)
# appliance-judge.service: each replica judged by progress (applianctl/judge/), rewritten every round
JUDGE_STATE = RUN_DIR / "judge.json"
# the judge's loopback endpoints: Caddy's /health asks JUDGE_HEALTH (200 while a replica is alive,
# 503 with a reason), HAProxy's agent-check asks JUDGE_AGENT per server ("up" or "down")
JUDGE_HEALTH = "127.0.0.1:8091"
JUDGE_AGENT = "127.0.0.1:8092"
# appliance-attest.service (applianctl/attest/): the fleet's verifier asks it through the metrics site
ATTEST = "127.0.0.1:8093"
# the firmware's TPM event log (TCG PC Client, crypto-agile), which a quote carries for PCR 7's replay
TPM_EVENT_LOG = _path("TPM_EVENT_LOG", "/sys/kernel/security/tpm0/binary_bios_measurements")

# Persistent state on /var
VAR_DIR = _path("VAR_DIR", "/var")  # what a factory reset wipes (applianctl/factory_reset.py)
STATE_DIR = _path("STATE_DIR", "/var/lib/appliance")
TLS_DIR = STATE_DIR / "tls"  # ca.crt, ca.key, server.crt, server.key
# appliance-host.service writes these from the effective configuration (image, or the install plan)
METRICS_CLIENT_CA = RUN_DIR / "metrics-client-ca.pem"  # the proxy's metrics site: scrapers' CAs
JOURNAL_UPLOAD_CA = RUN_DIR / "journal-upload-ca.pem"  # the log collector's CA
JOURNAL_UPLOAD_ENV = RUN_DIR / "journal-upload.env"  # UPLOAD_URL=, read by appliance-journal-upload.service
# appliance-metrics.service's textfiles, which node_exporter serves (status and GPU gauges)
METRICS_TEXTFILE_DIR = RUN_DIR / "metrics"
NODE_EXPORTER = "127.0.0.1:9100"  # loopback only: scrapers reach it through the proxy
PROC_CMDLINE = _path("PROC_CMDLINE", "/proc/cmdline")
BOOT_ID = _path("BOOT_ID", "/proc/sys/kernel/random/boot_id")


def factory_reset_request_path() -> Path:
    """`applianctl factory-reset`: the reset the next boot runs (appliance-factory-reset.service)."""
    return STATE_DIR / "factory-reset.json"


def last_factory_reset_path() -> Path:
    return STATE_DIR / "last-factory-reset.json"


def remediation_path() -> Path:
    """The hive-wide fault ladder's counters (applianctl/judge/hive.py): they survive a reboot."""
    return STATE_DIR / "remediation.json"


# The updater's state, joined at each call: tests that move STATE_DIR move these with it.
def update_dir() -> Path:
    return STATE_DIR / "update"


def staged_update_dir() -> Path:
    """`applianctl update --download-only`: the verified bundle waiting for `--apply`; its record
    (staged.json) names the one complete directory beside it."""
    return update_dir() / "staged"


def update_staging_dir() -> Path:
    """Downloads, one directory per version."""
    return update_dir() / "staging"


def update_source_dir() -> Path:
    """What systemd-sysupdate reads: the Source Path= of sysupdate.d/*.transfer."""
    return update_dir() / "source"


def update_lock_path() -> Path:
    """Held (flock) by the update that is running."""
    return update_dir() / "lock"


def engines_record_path() -> Path:
    """version -> engine digest, recorded by the updater from signed bundle indexes."""
    return update_dir() / "engines.json"


def last_update_path() -> Path:
    return update_dir() / "last-update.json"


def last_assessment_path() -> Path:
    return update_dir() / "last-assessment.json"


def last_rollback_path() -> Path:
    return update_dir() / "last-rollback.json"


def boots_record_path() -> Path:
    """This boot of the running version and the unclean boots before it (applianctl/slots/crashloop.py)."""
    return update_dir() / "boots.json"


def gpu_selftest_baseline_path() -> Path:
    """The correctable ECC counts of the last GPU self-test that passed: the next boot's baseline."""
    return STATE_DIR / "gpu-selftest-baseline.json"


def channel_path() -> Path:
    """The highest sequence of each channel's index the updater acted on (applianctl/update/channel.py)."""
    return update_dir() / "channel.json"


def freshness_path() -> Path:
    """The highest timestamp sequence accepted, per timestamp key (appliance.signed.timestamp)."""
    return update_dir() / "freshness.json"


def timestamp_keys_dir(trusted_keys_dir: Path) -> Path:
    """The timestamp keys beside TRUSTED_KEYS_DIR (the release keys), as the image carries them."""
    return trusted_keys_dir.parent / TIMESTAMP_KEYS_DIR.name


SHM_DIR = _path("SHM_DIR", "/dev/shm")

# Boot credentials naming the weights' source (a mirror's URL or a directory) and its CA
# (applianctl model fetch --at-boot; builder.qemu hands the build host's mirror over in them).
MODEL_SOURCE_CREDENTIAL = "appliance.model_source"
MODEL_SOURCE_CA_CREDENTIAL = "appliance.model_source_ca"

# The engine: one quadlet template instance per replica (units/appliance-engine@.container.j2);
# replica I is appliance-engine@I.service running the container appliance-engine-I.
ENGINE_TEMPLATE = "appliance-engine@.service"
ENGINE_UNITS_GLOB = "appliance-engine@*.service"


def engine_unit(replica: int = 0) -> str:
    return f"appliance-engine@{replica}.service"


def engine_container(replica: int = 0) -> str:
    return f"appliance-engine-{replica}"


def engine_units(replicas: int) -> tuple[str, ...]:
    return tuple(engine_unit(i) for i in range(replicas))


# The appliance's units, in the order status shows them (ENGINE stands for every replica's unit).
ENGINE = "ENGINE"
# with several replicas, the balancer in front of them (appliance/balancer.py)
BALANCER = "appliance-balancer.service"
_UNITS = (
    "appliance-verify.service",
    "appliance-preflight.service",
    "appliance-shm-clean.service",
    "appliance-engine-store.service",
    "appliance-gpu-selftest.service",  # every GPU checked before an engine starts (none in the demo)
    "appliance-model-fetch.service",  # the weights, when any is missing (a first boot)
    ENGINE,
    BALANCER,
    "appliance-startup-report.service",
    "appliance-tls.service",
    "appliance-proxy.service",
    # seen from outside: the metrics scrapers reach, the journal sent to the collector
    "appliance-node-exporter.service",
    "appliance-journal-upload.service",
)


def units(replicas: int = 1) -> tuple[str, ...]:
    """The appliance's units with REPLICAS engine units, in the order status shows them."""
    return tuple(u for name in _UNITS if name != BALANCER or replicas > 1
                 for u in (engine_units(replicas) if name == ENGINE else (name,)))
