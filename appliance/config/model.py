# SPDX-License-Identifier: MIT
"""The configuration model: the frozen dataclasses appliance.toml and appliance.json load into.

Each field carries its check (appliance/config/checks.py); the values the build and the device
derive from the settings are properties here. `cross_checks` holds the rules that tie settings
together; `ConfigLoader` words the schema loader's faults (appliance.toml, appliance.json, the plan).
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import schema
from appliance.config import checks
from appliance.errors import ConfigError, UserError
from appliance.hashing import DIGEST, SHA256
from appliance.patterns import MODEL_ID, REVISION, VERSION, VERSION_FORM

PROFILES = ("production", "demo")
# The runbook's smoke prompt (docs/reference-stack.md): applianctl smoke sends it, and each
# engine replica's warm-up request (builder/render.py) is a one-token completion of it.
SMOKE_PROMPT = "Calculate 17 * 23. Answer with the number only."
# The first DRM render node's minor number (/dev/dri/renderD128).
RENDER_MINOR_BASE = 128
GIB = 1 << 30

_check = schema.check
_each = schema.each


@dataclass(frozen=True)
class Appliance:
    name: str = field(metadata=_check(checks.is_dns_name))
    version: str = field(metadata=_check(checks.pattern(VERSION, f"{VERSION_FORM}, e.g. 1.4.0")))
    # The oldest version a release bundle of this build may be installed over.
    min_version: str = field(default="0", metadata=_check(checks.pattern(VERSION, f"{VERSION_FORM}, e.g. 1.0.0")))


@dataclass(frozen=True)
class Os:
    release: str = field(metadata=_check(checks.one_of("trixie")))
    mirror: str = field(default="", metadata=_check(checks.is_url))
    security_mirror: str = field(default="", metadata=_check(checks.is_url))
    hostname: str = field(default="appliance", metadata=_check(checks.is_dns_name))
    ssh_authorized_keys: tuple[str, ...] = field(default=(), metadata=_each(checks.is_ssh_key))
    # Secure Boot's allowed-signatures list (db) holds the appliance's certificate and, unless this
    # is false, Microsoft's third-party UEFI CAs, which sign the option ROMs of NICs, RAID
    # controllers and GPUs: without them a server may not bring up its devices under Secure Boot.
    secure_boot_microsoft_ca: bool = True
    # How long systemd waits for a device (the disk holding /usr, say) before emergency mode, which
    # reboots and uses up a boot try: the kernel command line's systemd.default_device_timeout_sec=,
    # signed into the kernel image (under Secure Boot nothing else reaches the command line).
    device_timeout_sec: int = field(default=90, metadata=_check(checks.between(10, 3600)))
    # The GPU's kernel driver: "inbox" (Debian's amdgpu, in the kernel the image signs) or "dkms"
    # (AMD's amdgpu-dkms from the operator's package, file of this repository, pinned by SHA-256).
    # cross_checks refuses "dkms" (AMDGPU_DKMS_UNDER_SECURE_BOOT says why).
    amdgpu: str = field(default="inbox", metadata=_check(checks.one_of("inbox", "dkms")))
    amdgpu_dkms_package: str = field(default="", metadata=_check(lambda v: None if v == "" else checks.is_repo_file(v)))
    amdgpu_dkms_sha256: str = field(
        default="", metadata=_check(lambda v: None if v == "" or SHA256.fullmatch(v) else "64 lower-case hex digits")
    )


@dataclass(frozen=True)
class Model:
    id: str = field(metadata=_check(checks.pattern(MODEL_ID, "a Hugging Face model id, e.g. deepseek-ai/DeepSeek-V4-Flash-0731")))
    revision: str = field(metadata=_check(checks.pattern(REVISION, "a full commit hash: 40 lower-case hex digits")))
    cache_dir: str = field(default="/var/lib/appliance/huggingface", metadata=_check(checks.is_abs_path))
    # The signed weights manifest (python3 -m builder weights pin), a file of this repository;
    # "" ships none and the weights are not checked.
    weights_manifest: str = field(default="", metadata=_check(lambda v: None if v == "" else checks.is_repo_file(v)))
    # Where `applianctl model fetch` gets the weights by default: an https:// mirror or a directory.
    source: str = field(default="", metadata=_check(checks.is_weights_source))

    # Where the engine container sees cache_dir (the compose stack's Hugging Face cache mount).
    container_cache: typing.ClassVar[str] = "/root/.cache/huggingface"

    @property
    def _snapshot(self) -> str:
        return f"hub/models--{self.id.replace('/', '--')}/snapshots/{self.revision}"

    @property
    def snapshot_path(self) -> str:
        """Where the engine finds the weights inside its container (the compose stack's first argument)."""
        return f"{self.container_cache}/{self._snapshot}"

    @property
    def weights_dir(self) -> str:
        """The same snapshot directory on the appliance's /var."""
        return f"{self.cache_dir}/{self._snapshot}"


@dataclass(frozen=True)
class PinnedFile:
    """An overlay or tuning table: a file of this repository mounted read-only in the engine."""

    file: str = field(metadata=_check(checks.is_repo_file))
    target: str = field(metadata=_check(checks.is_abs_path))
    sha256: str = field(
        default="", metadata=_check(lambda v: None if v == "" or SHA256.fullmatch(v) else "64 lower-case hex digits")
    )


@dataclass(frozen=True)
class Health:
    path: str = field(default="/health", metadata=_check(checks.pattern(checks.URL_PATH, "a URL path such as /health")))
    interval_s: int = field(default=30, metadata=_check(checks.between(1, 86400)))
    timeout_s: int = field(default=5, metadata=_check(checks.between(1, 86400)))
    retries: int = field(default=5, metadata=_check(checks.between(1, 1000)))
    start_period_s: int = field(default=1200, metadata=_check(checks.between(1, 7 * 86400)))


@dataclass(frozen=True)
class Shm:
    margin_gib: float = field(
        default=8.0, metadata=_check(lambda v: None if 0 < v <= checks.MAX_GIB else f"a number greater than 0, at most {checks.MAX_GIB:g}")
    )


# Set in every engine's environment whatever engine.env says (engine.env may only repeat them).
FIXED_ENV = {"PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class Engine:
    image: str = field(metadata=_check(checks.pattern(checks.IMAGE_NAME, "an image name without tag, e.g. vllm/vllm-openai-rocm")))
    digest: str = field(metadata=_check(checks.pattern(DIGEST, "'sha256:' followed by 64 lower-case hex digits")))
    args: tuple[str, ...] = field(metadata=_each(checks.is_arg))
    # What the image runs; the arguments follow `serve MODEL_PATH`.
    entrypoint: tuple[str, ...] = field(default=("vllm",), metadata=_each(checks.is_arg))
    # Extra read-only host mounts, HOST:CONTAINER (the demo's stand-in borrows the OS's Python).
    volumes: tuple[str, ...] = field(default=(), metadata=_each(checks.is_volume))
    port: int = field(default=8000, metadata=_check(checks.is_port))
    init: bool = True
    ipc: str = field(default="host", metadata=_check(checks.one_of("host", "private")))
    devices: tuple[str, ...] = field(default=(), metadata=_each(checks.is_abs_path))
    capabilities: tuple[str, ...] = field(
        default=(), metadata=_each(checks.pattern(checks.CAPABILITY, "a capability name without CAP_, e.g. SYS_PTRACE"))
    )
    memlock: str = field(
        default="unlimited",
        metadata=_check(
            lambda v: None if v == "unlimited" or (re.fullmatch(r"[0-9]{1,18}", v) and int(v) > 0) else "'unlimited' or a number of bytes"
        ),
    )
    security_opt: tuple[str, ...] = field(
        default=(), metadata=_each(checks.one_of("seccomp=unconfined", "label=disable", "no-new-privileges"))
    )
    stop_timeout_s: int = field(default=120, metadata=_check(checks.between(1, 86400)))
    log_max_size: str = field(default="100m", metadata=_check(checks.pattern(checks.SIZE, "a size such as 100m")))
    log_max_files: int = field(default=5, metadata=_check(checks.between(1, 1000)))
    aiter_cache_dir: str = field(default="/var/lib/appliance/aiter", metadata=_check(checks.is_abs_path))
    crash_dir: str = field(default="/var/crash/vllm", metadata=_check(checks.is_abs_path))
    env: Mapping[str, str] = field(
        default_factory=dict,
        metadata={
            **_each(checks.is_env_value),
            "keys": lambda k: None if checks.ENV_NAME.match(k) else "a name of letters, digits and '_'",
        },
    )
    health: Health = field(default_factory=Health)
    shm: Shm = field(default_factory=Shm)
    overlays: tuple[PinnedFile, ...] = ()
    tuning: tuple[PinnedFile, ...] = ()
    # Each of the two engine slots (docs/disk-layout.md): every engine image this appliance will
    # ever run must fit, since slot B is made once at first boot and never resized.
    slot_size_gib: float = field(default=40.0, metadata=_check(checks.is_slot_size))

    @property
    def slot_bytes(self) -> int:
        """The size of each engine slot's data partition."""
        return int(self.slot_size_gib * 1024) * (1 << 20)

    @property
    def reference(self) -> str:
        """The image by digest, as podman runs it."""
        return f"{self.image}@{self.digest}"

    def arg_value(self, name: str) -> str | None:
        """The value of `--name VALUE` or `--name=VALUE` in the argument list."""
        for i, arg in enumerate(self.args):
            if arg == name and i + 1 < len(self.args):
                return self.args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    @property
    def offload_gib(self) -> float:
        """CPU KV offload size (GiB), read from the engine's own --kv-offloading-size (checked by
        the loader to be a plain decimal number)."""
        value = self.arg_value("--kv-offloading-size")
        return (checks.parse_decimal(value) or 0.0) if value else 0.0

    @property
    def served_model_name(self) -> str | None:
        return self.arg_value("--served-model-name")

    @property
    def environment(self) -> dict[str, str]:
        """What every engine (each replica) runs with: engine.env, then the variables the appliance
        always sets (FIXED_ENV: PYTHONHASHSEED=0, so that every replica hashes prompts' prefix
        blocks alike)."""
        return {**self.env, **FIXED_ENV}


@dataclass(frozen=True)
class Expected:
    model_memory_gib: float | None = field(default=None, metadata=_check(checks.between(0, checks.MAX_GIB)))
    draft_params: int | None = field(default=None, metadata=_check(checks.between(0, 10**15)))
    kv_cache_tokens: int | None = field(default=None, metadata=_check(checks.between(0, 10**15)))
    max_concurrency: float | None = field(default=None, metadata=_check(checks.between(0, 10**9)))
    offload_mmap_gb: float | None = field(default=None, metadata=_check(checks.between(0, checks.MAX_GIB)))


@dataclass(frozen=True)
class Gpu:
    required: bool = True
    min_vram_headroom_mib: int = field(default=1024, metadata=_check(checks.positive))


@dataclass(frozen=True)
class Proxy:
    hostname: str = field(metadata=_check(checks.is_dns_name))
    tls: str = field(default="internal", metadata=_check(checks.one_of("internal", "acme")))
    acme_email: str = field(
        default="", metadata=_check(lambda v: None if v == "" or checks.EMAIL.fullmatch(v) else "an e-mail address such as ops@example.net")
    )
    https_port: int = field(default=443, metadata=_check(checks.is_port))
    http: str = field(default="redirect", metadata=_check(checks.one_of("redirect", "close")))
    allowed_cidrs: tuple[str, ...] = field(default=("127.0.0.1/32",), metadata=_each(checks.is_cidr))
    allowed_paths: tuple[str, ...] = field(
        default=("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/generate"),
        metadata=_each(checks.pattern(checks.URL_PATH, "a URL path such as /v1/models")),
    )
    metrics_cidrs: tuple[str, ...] = field(default=(), metadata=_each(checks.is_cidr))
    # With several replicas (topology.layout): requests that carry this header go to the replica its
    # value hashes to, so that a conversation's turns reuse that replica's prefix cache; the others
    # to the replica with the fewest requests in flight. "": no affinity.
    affinity_header: str = field(default="", metadata=_check(checks.is_header_name))


@dataclass(frozen=True)
class Metrics:
    """The appliance's own metrics (node_exporter: the host, its units, the status and the GPUs; and
    the engine's) on a port of their own through the proxy, for scrapers, who are not clients:
    https://HOST:PORT/metrics and /engine/metrics (docs/fleet.md)."""

    port: int = field(default=9443, metadata=_check(checks.is_port))
    # who may scrape, besides the appliance itself; empty: no one from the network
    allowed_cidrs: tuple[str, ...] = field(default=(), metadata=_each(checks.is_cidr))
    # PEM CA certificates: a scraper must also present a client certificate one of them signed
    client_ca: str = field(default="", metadata=schema.multiline(checks.is_pem_certificates))
    # how often appliance-metrics.timer writes the status and GPU gauges (one status run each)
    refresh_s: int = field(default=60, metadata=_check(checks.between(15, 3600)))


@dataclass(frozen=True)
class Logs:
    """The journal off the box: systemd-journal-upload to a systemd-journal-remote over TLS (the
    appliance presents a client certificate of its own). The local journal is bounded by
    engine.log_max_size x engine.log_max_files (journald's SystemMaxUse=)."""

    upload_url: str = field(default="", metadata=_check(checks.is_https_url))
    # PEM: the CA that signed the collector's certificate (required with upload_url)
    upload_ca: str = field(default="", metadata=schema.multiline(checks.is_pem_certificates))


DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True)
class MaintenanceWindow:
    """When the update timer may install and reboot: from START (HH:MM, UTC) for DURATION_MIN
    minutes, on DAYS (the day a window starts; it may run past midnight). appliance/rollout.py."""

    start: str = field(metadata=_check(checks.pattern(re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]\Z"), "a time of day HH:MM (UTC)")))
    duration_min: int = field(metadata=_check(checks.between(1, 1440)))
    days: tuple[str, ...] = field(default=DAYS, metadata=_each(checks.one_of(*DAYS)))

    @property
    def start_min(self) -> int:
        hours, minutes = self.start.split(":")
        return int(hours) * 60 + int(minutes)


@dataclass(frozen=True)
class Update:
    url: str = field(default="", metadata=_check(checks.is_url))
    assessment_deadline_s: int = field(default=3600, metadata=_check(checks.between(1, 7 * 86400)))
    # boot tries a newly installed version gets (systemd-boot's counter, TriesLeft= of the kernel image)
    boot_tries: int = field(default=3, metadata=_check(checks.between(1, 20)))
    # what the update timer does with a new bundle at url: install it into the inactive slot, or
    # only download and verify it into /var for `applianctl update --apply` in a maintenance window
    timer_action: str = field(default="install", metadata=_check(checks.one_of("install", "download-only")))
    # when the update timer may install from a channel (none: any time)
    maintenance_windows: tuple[MaintenanceWindow, ...] = ()


@dataclass(frozen=True)
class Topology:
    """The GPUs this appliance serves with and how the engines share them: LAYOUT is REPLICASxTP,
    that many separate engines (replicas; vLLM's data parallelism would make one failure domain of
    a mixture-of-experts model) of TP GPUs each (tensor parallel). The default is one engine on
    one GPU. cross_checks ties it to the engine's arguments and /dev/shm; `check_host` to a host."""

    gpus: int = field(default=1, metadata=_check(checks.between(1, checks.MAX_GPUS)))
    layout: str = field(default="1x1", metadata=_check(checks.is_layout))
    # The host's memory (MemTotal, GiB) this build is for: every replica's CPU KV offload file and
    # engine.shm.margin_gib, in /dev/shm, must fit in it with memory_reserve_gib to spare for
    # the OS and the engines' own processes. 0: not checked at build, only at boot.
    memory_gib: float = field(default=0.0, metadata=_check(checks.between(0, checks.MAX_GIB)))
    memory_reserve_gib: float = field(default=32.0, metadata=_check(checks.between(0, checks.MAX_GIB)))
    # Staggered starts, so that the replicas do not all read the weights from the same disk at once:
    # replica I starts once replica I-1 is healthy (has answered its warm-up request), and at the
    # latest I x stagger_s after it was started itself (applianctl/engine/stagger.py). 0: all at once.
    stagger_s: int = field(default=300, metadata=_check(checks.between(0, 3600)))

    @property
    def replicas(self) -> int:
        return int(self.layout.split("x")[0])

    @property
    def tensor_parallel(self) -> int:
        return int(self.layout.split("x")[1])

    @property
    def gpus_used(self) -> int:
        return self.replicas * self.tensor_parallel

    def replica_gpus(self, i: int) -> tuple[int, ...]:
        """The GPU indexes (0-based, in the host's order) replica I runs on: consecutive blocks of TP."""
        if not 0 <= i < self.replicas:
            raise IndexError(f"replica {i} of {self.replicas}")
        return tuple(range(i * self.tensor_parallel, (i + 1) * self.tensor_parallel))


@dataclass(frozen=True)
class Config:
    profile: str
    appliance: Appliance
    os: Os
    model: Model
    engine: Engine
    proxy: Proxy
    expected: Expected = field(default_factory=Expected)
    gpu: Gpu = field(default_factory=Gpu)
    update: Update = field(default_factory=Update)
    metrics: Metrics = field(default_factory=Metrics)
    logs: Logs = field(default_factory=Logs)
    topology: Topology = field(default_factory=Topology)

    @property
    def replicas(self) -> int:
        return self.topology.replicas

    def replica_port(self, i: int) -> int:
        """Replica I's loopback port: engine.port, then every second port (the later two-GPU stack
        ran its replicas on 8000 and 8002)."""
        if not 0 <= i < self.replicas:
            raise IndexError(f"replica {i} of {self.replicas}")
        return self.engine.port + 2 * i

    @property
    def balancer_port(self) -> int:
        """With several replicas, the balancer's loopback port (appliance/balancer.py): the next
        after the replicas'."""
        return self.engine.port + 2 * self.replicas

    def replica_devices(self, i: int) -> tuple[str, ...]:
        """The device nodes replica I's container gets: engine.devices, with /dev/dri narrowed to
        its own GPUs' render nodes when the GPUs are shared out among replicas (ROCm's visibility
        variables do not isolate a container; only the device nodes it is given do). GPU G is
        /dev/dri/renderD(128 + G): amdgpu numbers render nodes in probe order, the order the KFD
        and amd-smi number the GPUs in (a server's BMC display has no render node); the GPU
        self-test checks it against the KFD's drm_render_minor before any replica starts."""
        if self.replicas == 1:
            return self.engine.devices
        narrowed = tuple(f"/dev/dri/renderD{RENDER_MINOR_BASE + g}" for g in self.topology.replica_gpus(i))
        return tuple(d for device in self.engine.devices for d in (narrowed if device == "/dev/dri" else (device,)))

    @property
    def offload_bytes_per_replica(self) -> int:
        """The CPU KV offload file each replica maps in /dev/shm (its --kv-offloading-size)."""
        return int(self.engine.offload_gib * GIB)

    @property
    def shm_required_gib(self) -> float:
        return self.replicas * self.engine.offload_gib + self.engine.shm.margin_gib

    @property
    def shm_required_bytes(self) -> int:
        """What /dev/shm must have free before the engines start: every replica's offload file plus
        the margin."""
        return int(self.shm_required_gib * GIB)

    @property
    def shm_size_mib(self) -> int:
        """The size /dev/shm is mounted with: the requirement plus 64 MiB for everything else there."""
        return math.ceil(self.shm_required_gib * 1024) + 64

    @property
    def shm_need(self) -> str:
        """The requirement in words, e.g. '8 x 96 GiB KV offload + 8 GiB margin'."""
        per = f"{self.replicas} x {self.engine.offload_gib:g}" if self.replicas > 1 else f"{self.engine.offload_gib:g}"
        return f"{per} GiB KV offload + {self.engine.shm.margin_gib:g} GiB margin"

    @property
    def served_model(self) -> str:
        """The model name clients ask for: --served-model-name, else the model id."""
        return self.engine.served_model_name or self.model.id

    @property
    def health_path(self) -> str:
        """The engine's readiness path (engine.health.path), as probes and the proxy ask for it."""
        return self.engine.health.path

    def to_json(self) -> dict[str, Any]:
        """The configuration as the device reads it (/usr/lib/appliance/appliance.json)."""
        data = schema.plain(self)
        assert isinstance(data, dict)
        data["engine"]["reference"] = self.engine.reference
        data["engine"]["offload_gib"] = self.engine.offload_gib
        data["engine"]["served_model_name"] = self.engine.served_model_name
        data["model"]["snapshot_path"] = self.model.snapshot_path
        data["model"]["weights_dir"] = self.model.weights_dir
        return data


class ConfigLoader(schema.Loader):
    """The schema loader's faults as appliance.toml, appliance.json and the install plan word them."""

    def __init__(self, path: Path, collect: list[UserError] | None = None) -> None:
        super().__init__(str(path), collect)

    def invalid(self, key: str, value: Any, expected: str) -> ConfigError:
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        return ConfigError(f"{self.where}: {key} = {shown}: invalid", hint=f"expected {expected}")

    def unknown(self, key: str, value: Any, known: list[str]) -> ConfigError:
        return ConfigError(f"{self.where}: unknown key {key!r} = {schema.shown(value, 60)}", hint=schema.known_keys(key, known))

    def missing(self, key: str, tp: Any) -> ConfigError:
        return ConfigError(f"{self.where}: missing key {key!r}", hint=f"add {key} ({schema.type_name(tp)})")


def cross_checks(path: Path, config: Config) -> None:
    """Rules that tie settings together."""
    targets = [f.target for f in (*config.engine.overlays, *config.engine.tuning)]
    for target in targets:
        if targets.count(target) > 1:
            raise ConfigError(f"{path}: target {target!r} is mounted twice", hint="give each overlay and table its own target")
    if config.proxy.tls == "acme" and not config.proxy.acme_email:
        raise ConfigError(f"{path}: proxy.tls = 'acme' needs proxy.acme_email", hint='set proxy.acme_email or use tls = "internal"')
    if config.engine.arg_value("--port") not in (None, str(config.engine.port)):
        raise ConfigError(
            f"{path}: engine.args has --port {config.engine.arg_value('--port')} but engine.port = {config.engine.port}",
            hint="make them the same",
        )
    offload = config.engine.arg_value("--kv-offloading-size")
    if offload is not None and ((gib := checks.parse_decimal(offload)) is None or gib > checks.MAX_GIB):
        raise ConfigError(
            f"{path}: engine.args has --kv-offloading-size {offload!r}",
            hint=f"a size in GiB written with ASCII digits, e.g. 96 or 0.5, at most {checks.MAX_GIB:g}",
        )
    if config.logs.upload_url and not config.logs.upload_ca:
        raise ConfigError(f"{path}: logs.upload_url needs logs.upload_ca",
                          hint="give the PEM of the CA that signed the collector's certificate")
    if config.metrics.port in (config.proxy.https_port, config.engine.port, 80):
        raise ConfigError(f"{path}: metrics.port = {config.metrics.port} is taken", hint="give the metrics a port of their own, e.g. 9443")
    _topology_checks(path, config)
    _driver_checks(path, config.os)
    if config.gpu.required and config.profile == "demo":
        raise ConfigError(f"{path}: profiles.demo needs gpu.required = false", hint="the demo runs without a GPU")


def _topology_checks(path: Path, config: Config) -> None:
    """topology against itself, the engine's arguments, the ports and /dev/shm."""
    for name, value in FIXED_ENV.items():
        if config.engine.env.get(name, value) != value:
            raise ConfigError(f"{path}: engine.env.{name} = {config.engine.env[name]!r}: every engine runs with {name}={value}",
                              hint=f"leave {name} out of engine.env")
    t = config.topology
    if t.gpus_used != t.gpus:
        raise ConfigError(
            f"{path}: topology.layout = {t.layout!r} uses {t.replicas} x {t.tensor_parallel} = {t.gpus_used} GPU(s), "
            f"topology.gpus = {t.gpus}",
            hint=f"replicas x tensor parallel must equal gpus: for {t.gpus} GPU(s) one of "
            + (", ".join(layout for layout in checks.LAYOUT_PRESETS if _uses(layout) == t.gpus) or "a layout that adds up"),
        )
    for name in ("--tensor-parallel-size", "-tp"):
        tp = config.engine.arg_value(name)
        if tp is not None and tp != str(t.tensor_parallel):
            raise ConfigError(
                f"{path}: engine.args has {name} {tp} but topology.layout = {t.layout!r} (tensor parallel {t.tensor_parallel})",
                hint=f"make them the same, or leave {name} out",
            )
    dp = config.engine.arg_value("--data-parallel-size")
    if dp not in (None, "1"):
        raise ConfigError(
            f"{path}: engine.args has --data-parallel-size {dp}",
            hint="replicas are separate engines: set topology.layout (e.g. 8x1) and leave --data-parallel-size out",
        )
    last = config.replica_port(t.replicas - 1)
    taken = {config.metrics.port, config.proxy.https_port, 80}
    clash = sorted(taken & {config.replica_port(i) for i in range(t.replicas)})
    if last > 65535 or clash:
        raise ConfigError(
            f"{path}: replica ports engine.port + 2 x i = {config.engine.port}..{last} "
            + (f"include port {clash[0]}, which is taken" if clash else "run past 65535"),
            hint="move engine.port so that every replica's port is free",
        )
    need = config.shm_required_gib + t.memory_reserve_gib
    if t.memory_gib and need > t.memory_gib:
        room = (t.memory_gib - t.memory_reserve_gib - config.engine.shm.margin_gib) / t.replicas
        raise ConfigError(
            f"{path}: /dev/shm needs {config.shm_required_gib:g} GiB ({config.shm_need}) + "
            f"{t.memory_reserve_gib:g} GiB reserved, more than topology.memory_gib = {t.memory_gib:g}",
            hint=f"lower --kv-offloading-size to at most {max(room, 0):.4g} GiB per replica, or use fewer replicas or more memory",
        )


# Why amdgpu-dkms cannot run on a sealed appliance (docs/architecture.md, "The GPU driver"): the
# appliance always boots under Secure Boot (the installer enrolls its keys), and then Debian's
# kernel (lockdown) loads only modules signed by a key in its builtin keyring (Debian's) or, through
# shim, in the machine keyring (MOK). The appliance boots systemd-boot from its own db, without
# shim: no key of the operator's reaches a keyring the kernel checks modules against, so modules
# that DKMS builds could never load. Refused at build, not discovered on a server.
AMDGPU_DKMS_UNDER_SECURE_BOOT = (
    "os.amdgpu = \"dkms\": under Secure Boot, always on for this appliance, Debian's kernel loads only modules "
    "signed by Debian's key (or a shim MOK key, and the appliance boots without shim), so amdgpu-dkms's modules would never load"
)


def _driver_checks(path: Path, os_: Os) -> None:
    pinned = bool(os_.amdgpu_dkms_package) and bool(os_.amdgpu_dkms_sha256)
    if os_.amdgpu == "inbox" and (os_.amdgpu_dkms_package or os_.amdgpu_dkms_sha256):
        raise ConfigError(f"{path}: os.amdgpu_dkms_package and os.amdgpu_dkms_sha256 apply with os.amdgpu = \"dkms\" only",
                          hint="remove them, or see docs/architecture.md (the GPU driver)")
    if os_.amdgpu == "dkms" and not pinned:
        raise ConfigError(f"{path}: os.amdgpu = \"dkms\" needs os.amdgpu_dkms_package and os.amdgpu_dkms_sha256",
                          hint="name AMD's amdgpu-dkms package (a file of this repository) and its SHA-256")
    if os_.amdgpu == "dkms":
        raise ConfigError(f"{path}: {AMDGPU_DKMS_UNDER_SECURE_BOOT}",
                          hint="keep os.amdgpu = \"inbox\" (Debian's amdgpu supports the MI300X); docs/architecture.md says "
                               "what a signed amdgpu-dkms would need")


def _uses(layout: str) -> int:
    replicas, tp = layout.split("x")
    return int(replicas) * int(tp)


def check_host(config: Config, gpu_count_seen: int, mem_total_bytes: int, shm_total_bytes: int) -> list[str]:
    """The topology against the host it boots on: the GPUs seen (when the profile needs GPUs), the
    memory (MemTotal) and /dev/shm's size. One line per problem; none when it fits. Pure: the
    caller reads the host. More GPUs than the topology uses is no problem (the rest stay idle)."""
    t = config.topology
    problems: list[str] = []
    if config.gpu.required and gpu_count_seen < t.gpus:
        problems.append(
            f"{gpu_count_seen} GPU(s) seen, topology {t.layout} ({t.replicas} replica(s) x tensor parallel "
            f"{t.tensor_parallel}) needs {t.gpus}"
        )
    need = config.shm_required_bytes
    if shm_total_bytes < need:
        problems.append(
            f"/dev/shm holds {shm_total_bytes / GIB:.2f} GiB, the {t.replicas} replica(s) need "
            f"{need / GIB:.2f} GiB ({config.shm_need})"
        )
    if mem_total_bytes < need + t.memory_reserve_gib * GIB:
        problems.append(
            f"{mem_total_bytes / GIB:.2f} GiB of memory, the {t.replicas} replica(s) need {need / GIB:.2f} GiB in "
            f"/dev/shm ({config.shm_need}) and {t.memory_reserve_gib:g} GiB to spare"
        )
    return problems
