"""The configuration model: appliance.toml parsed into frozen dataclasses.

One table of dataclasses describes every setting; a single generic loader walks it, so unknown
keys, wrong types and bad values are all reported the same way: one line naming the file, the
key and the value, and a hint. Everything the build produces is derived from `Config`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import schema
from appliance.errors import ConfigError, UserError
from appliance.hashing import DIGEST as _DIGEST
from appliance.hashing import SHA256 as _SHA256
from appliance.patterns import MODEL_ID as _MODEL_ID
from appliance.patterns import REVISION as _REVISION
from appliance.patterns import VERSION as _VERSION
from appliance.schema import Check

PROFILES = ("production", "demo")
GIB = 1 << 30

# ----------------------------------------------------------------------------------- checks
# Each check returns None when the value is good, else a hint saying what a good value is.


_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
_IMAGE_NAME = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
_EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_CAPABILITY = re.compile(r"^[A-Z_]+\Z")
_SIZE = re.compile(r"^[0-9]+[kmg]\Z")
_URL_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*\Z")
_SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com) [A-Za-z0-9+/=]+( [^\n\r]*)?\Z")
# Characters that would let a value break out of a line in a generated unit, Caddyfile or
# sources file.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029{}\"'`$\\;]")  # C0, C1 and Unicode line breaks too


def is_dns_name(value: str) -> str | None:
    labels = value.split(".")
    if len(value) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return "a DNS name: lower-case letters, digits and '-', labels joined by '.', e.g. appliance.example.net"
    return None


def _pattern(regex: re.Pattern[str], hint: str) -> Check:
    return lambda value: None if regex.fullmatch(value) else hint


def _is_cidr(value: str) -> str | None:
    try:
        # Written back exactly as parsed: no scope ids (which may carry any text), no padding.
        if "%" in value or str(ipaddress.ip_network(value, strict=True)) != value:
            raise ValueError(value)
    except ValueError:
        return "a network in CIDR notation with no host bits set, e.g. 10.0.0.0/8 or 192.0.2.7/32"
    return None


def _is_abs_path(value: str) -> str | None:
    parts = value.split("/")
    # ':' separates a mount's source, target and options (Volume=, AddDevice=)
    if not value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value or ":" in value:
        return "an absolute path without '..', ':', spaces or quotes, e.g. /opt/aiter-configs/table.csv"
    return None


def _is_repo_file(value: str) -> str | None:
    parts = value.split("/")
    if value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value or ":" in value or not value:
        return "a path relative to the project root, without '..' or ':', e.g. overlays/demo/file.py"
    return None


def _is_url(value: str) -> str | None:
    if value == "":
        return None
    if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~/-]*)?", value):
        return "an http(s) URL such as https://updates.example.net/appliance/, or \"\""
    return None


def _is_weights_source(value: str) -> str | None:
    if value == "" or (value.startswith("/") and _is_abs_path(value) is None) or (value.startswith("https://") and _is_url(value) is None):
        return None
    return "an https:// URL of a mirror, an absolute directory, or \"\""


def _is_arg(value: str) -> str | None:
    if _UNSAFE.search(value.replace("%", "")) or not value:
        return "a non-empty argument without quotes, backslashes, '$', ';', braces or control characters"
    return None


def _is_env_value(value: str) -> str | None:
    if _UNSAFE.search(value):
        return "a value without quotes, backslashes, '$', ';', braces or control characters"
    return None


def _is_volume(value: str) -> str | None:
    parts = value.split(":")
    if len(parts) != 2 or any(_is_abs_path(p) for p in parts):
        return "HOST:CONTAINER, two absolute paths, e.g. /usr:/usr"
    return None


def _one_of(*choices: str) -> Check:
    return lambda value: None if value in choices else "one of " + ", ".join(repr(c) for c in choices)


# Numbers are bounded, so that every accepted value renders into a unit as a plain number that
# systemd and podman take as it is (no overflow, no exponent, no inf/NaN).
MAX_GIB = 1048576.0  # 1 PiB
_DECIMAL = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,6})?\Z")  # ASCII digits only: float() also takes '١٢', '1e3', 'inf'


def _between(low: float, high: float) -> Check:
    return lambda value: None if low <= value <= high else f"a number from {low:g} to {high:g}"


_positive = _between(1, schema.MAX_INT)


def parse_decimal(text: str) -> float | None:
    """TEXT as a plain decimal number (ASCII digits, an optional fraction), else None."""
    return float(text) if _DECIMAL.fullmatch(text) else None


def _slot_size(value: float) -> str | None:
    # whole MiB: the partitions systemd-repart makes and the hash tree sized for them stay aligned
    if not 1 / 64 <= value <= MAX_GIB or value * 1024 != int(value * 1024):
        return f"a size in GiB that is a whole number of MiB, from 0.015625 (16 MiB) to {MAX_GIB:g}, e.g. 40 or 0.0625"
    return None


def _port(value: int) -> str | None:
    return None if 0 < value < 65536 else "a TCP port between 1 and 65535"


_check = schema.check


_each = schema.each


# ----------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Appliance:
    name: str = field(metadata=_check(is_dns_name))
    version: str = field(metadata=_check(_pattern(_VERSION, "numbers joined by dots, e.g. 1.4.0")))
    # The oldest version a release bundle of this build may be installed over.
    min_version: str = field(default="0", metadata=_check(_pattern(_VERSION, "numbers joined by dots, e.g. 1.0.0")))


@dataclass(frozen=True)
class Os:
    release: str = field(metadata=_check(_one_of("trixie")))
    mirror: str = field(default="", metadata=_check(_is_url))
    security_mirror: str = field(default="", metadata=_check(_is_url))
    hostname: str = field(default="appliance", metadata=_check(is_dns_name))
    ssh_authorized_keys: tuple[str, ...] = field(
        default=(), metadata=_each(_pattern(_SSH_KEY, "an OpenSSH public key line, e.g. ssh-ed25519 AAAA... user@host"))
    )


@dataclass(frozen=True)
class Model:
    id: str = field(metadata=_check(_pattern(_MODEL_ID, "a Hugging Face model id, e.g. deepseek-ai/DeepSeek-V4-Flash-0731")))
    revision: str = field(metadata=_check(_pattern(_REVISION, "a full commit hash: 40 lower-case hex digits")))
    cache_dir: str = field(default="/var/lib/appliance/huggingface", metadata=_check(_is_abs_path))
    # The signed weights manifest (python3 -m builder weights pin), a file of this repository;
    # "" ships none and the weights are not checked (issue 14).
    weights_manifest: str = field(default="", metadata=_check(lambda v: None if v == "" else _is_repo_file(v)))
    # Where `applianctl model fetch` gets the weights by default: an https:// mirror or a directory.
    source: str = field(default="", metadata=_check(_is_weights_source))

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

    file: str = field(metadata=_check(_is_repo_file))
    target: str = field(metadata=_check(_is_abs_path))
    sha256: str = field(
        default="", metadata=_check(lambda v: None if v == "" or _SHA256.fullmatch(v) else "64 lower-case hex digits")
    )


@dataclass(frozen=True)
class Health:
    path: str = field(default="/health", metadata=_check(_pattern(_URL_PATH, "a URL path such as /health")))
    interval_s: int = field(default=30, metadata=_check(_between(1, 86400)))
    timeout_s: int = field(default=5, metadata=_check(_between(1, 86400)))
    retries: int = field(default=5, metadata=_check(_between(1, 1000)))
    start_period_s: int = field(default=1200, metadata=_check(_between(1, 7 * 86400)))


@dataclass(frozen=True)
class Shm:
    margin_gib: float = field(
        default=8.0, metadata=_check(lambda v: None if 0 < v <= MAX_GIB else f"a number greater than 0, at most {MAX_GIB:g}")
    )


@dataclass(frozen=True)
class Engine:
    image: str = field(metadata=_check(_pattern(_IMAGE_NAME, "an image name without tag, e.g. vllm/vllm-openai-rocm")))
    digest: str = field(metadata=_check(_pattern(_DIGEST, "'sha256:' followed by 64 lower-case hex digits")))
    args: tuple[str, ...] = field(metadata=_each(_is_arg))
    # What the image runs; the arguments follow `serve MODEL_PATH`.
    entrypoint: tuple[str, ...] = field(default=("vllm",), metadata=_each(_is_arg))
    # Extra read-only host mounts, HOST:CONTAINER (the demo's stand-in borrows the OS's Python).
    volumes: tuple[str, ...] = field(default=(), metadata=_each(_is_volume))
    port: int = field(default=8000, metadata=_check(_port))
    init: bool = True
    ipc: str = field(default="host", metadata=_check(_one_of("host", "private")))
    devices: tuple[str, ...] = field(default=(), metadata=_each(_is_abs_path))
    capabilities: tuple[str, ...] = field(
        default=(), metadata=_each(_pattern(_CAPABILITY, "a capability name without CAP_, e.g. SYS_PTRACE"))
    )
    memlock: str = field(
        default="unlimited",
        metadata=_check(
            lambda v: None if v == "unlimited" or (re.fullmatch(r"[0-9]{1,18}", v) and int(v) > 0) else "'unlimited' or a number of bytes"
        ),
    )
    security_opt: tuple[str, ...] = field(
        default=(), metadata=_each(_one_of("seccomp=unconfined", "label=disable", "no-new-privileges"))
    )
    stop_timeout_s: int = field(default=120, metadata=_check(_between(1, 86400)))
    log_max_size: str = field(default="100m", metadata=_check(_pattern(_SIZE, "a size such as 100m")))
    log_max_files: int = field(default=5, metadata=_check(_between(1, 1000)))
    aiter_cache_dir: str = field(default="/var/lib/appliance/aiter", metadata=_check(_is_abs_path))
    crash_dir: str = field(default="/var/crash/vllm", metadata=_check(_is_abs_path))
    env: Mapping[str, str] = field(
        default_factory=dict,
        metadata={**_each(_is_env_value), "keys": lambda k: None if _ENV_NAME.match(k) else "a name of letters, digits and '_'"},
    )
    health: Health = field(default_factory=Health)
    shm: Shm = field(default_factory=Shm)
    overlays: tuple[PinnedFile, ...] = ()
    tuning: tuple[PinnedFile, ...] = ()
    # Each of the two engine slots (docs/disk-layout.md): every engine image this appliance will
    # ever run must fit, since slot B is made once at first boot and never resized.
    slot_size_gib: float = field(default=40.0, metadata=_check(_slot_size))

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
        return (parse_decimal(value) or 0.0) if value else 0.0

    @property
    def served_model_name(self) -> str | None:
        return self.arg_value("--served-model-name")

    @property
    def shm_required_bytes(self) -> int:
        """What /dev/shm must have free before the engine starts: the offload file plus the margin."""
        return int((self.offload_gib + self.shm.margin_gib) * GIB)

    @property
    def shm_size_mib(self) -> int:
        """The size /dev/shm is mounted with: the requirement plus 64 MiB for everything else there."""
        return math.ceil((self.offload_gib + self.shm.margin_gib) * 1024) + 64


@dataclass(frozen=True)
class Expected:
    model_memory_gib: float | None = field(default=None, metadata=_check(_between(0, MAX_GIB)))
    draft_params: int | None = field(default=None, metadata=_check(_between(0, 10**15)))
    kv_cache_tokens: int | None = field(default=None, metadata=_check(_between(0, 10**15)))
    max_concurrency: float | None = field(default=None, metadata=_check(_between(0, 10**9)))
    offload_mmap_gb: float | None = field(default=None, metadata=_check(_between(0, MAX_GIB)))


@dataclass(frozen=True)
class Gpu:
    required: bool = True
    min_vram_headroom_mib: int = field(default=1024, metadata=_check(_positive))


@dataclass(frozen=True)
class Proxy:
    hostname: str = field(metadata=_check(is_dns_name))
    tls: str = field(default="internal", metadata=_check(_one_of("internal", "acme")))
    acme_email: str = field(
        default="", metadata=_check(lambda v: None if v == "" or _EMAIL.fullmatch(v) else "an e-mail address such as ops@example.net")
    )
    https_port: int = field(default=443, metadata=_check(_port))
    http: str = field(default="redirect", metadata=_check(_one_of("redirect", "close")))
    allowed_cidrs: tuple[str, ...] = field(default=("127.0.0.1/32",), metadata=_each(_is_cidr))
    allowed_paths: tuple[str, ...] = field(
        default=("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/generate"),
        metadata=_each(_pattern(_URL_PATH, "a URL path such as /v1/models")),
    )
    metrics_cidrs: tuple[str, ...] = field(default=(), metadata=_each(_is_cidr))


@dataclass(frozen=True)
class Update:
    url: str = field(default="", metadata=_check(_is_url))
    assessment_deadline_s: int = field(default=3600, metadata=_check(_between(1, 7 * 86400)))
    # boot tries a newly installed version gets (systemd-boot's counter, TriesLeft= of the kernel image)
    boot_tries: int = field(default=3, metadata=_check(_between(1, 20)))
    # what the update timer does with a new bundle at url: install it into the inactive slot, or
    # only download and verify it into /var for `applianctl update --apply` in a maintenance window
    timer_action: str = field(default="install", metadata=_check(_one_of("install", "download-only")))


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


# ----------------------------------------------------------------------------------- loading


class _Loader(schema.Loader):
    """appliance.toml's (and appliance.json's) wording of the loader's faults."""

    def __init__(self, path: Path, collect: list[UserError] | None = None) -> None:
        super().__init__(str(path), collect)

    def invalid(self, key: str, value: Any, expected: str) -> ConfigError:
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        return ConfigError(f"{self.where}: {key} = {shown}: invalid", hint=f"expected {expected}")

    def unknown(self, key: str, known: list[str]) -> ConfigError:
        return ConfigError(f"{self.where}: unknown key {key!r}", hint=f"known keys here: {', '.join(known)}")

    def missing(self, key: str, tp: Any) -> ConfigError:
        return ConfigError(f"{self.where}: missing key {key!r}", hint=f"add {key} ({schema.type_name(tp)})")


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value (lists included) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load(path: Path, profile: str = "production") -> Config:
    """Parse and check PATH for PROFILE; raise ConfigError with a one-line message on any fault."""
    config = _load(path, profile, None)
    assert config is not None
    return config


def problems(path: Path, profile: str = "production") -> tuple[Config | None, list[UserError]]:
    """Every fault of PATH for PROFILE (not only the first), and the configuration when there is none."""
    found: list[UserError] = []
    try:
        config = _load(path, profile, found)
    except ConfigError as e:  # the file itself cannot be read or parsed
        return None, [e]
    return (config if not found else None), found


def _load(path: Path, profile: str, collect: list[UserError] | None) -> Config | None:
    import tomllib

    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}", hint="use --profile production or --profile demo")
    try:
        raw = tomllib.loads(path.read_text())  # imported here: the device never reads TOML
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="run from the project root or pass --config PATH") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", hint="fix the syntax at the line named") from None
    profiles = raw.pop("profiles", {})
    if not isinstance(profiles, dict) or set(profiles) - set(PROFILES):
        unknown = sorted(set(profiles) - set(PROFILES)) if isinstance(profiles, dict) else profiles
        raise ConfigError(f"{path}: unknown profile(s) {unknown}", hint="profiles.demo is the only profile section")
    if profile != "production":
        raw = _merge(raw, profiles.get(profile, {}))
    config: Config | None = _Loader(path, collect).load(Config, raw, "", profile=profile)
    if config is not None:
        try:
            _cross_checks(path, config)
        except ConfigError as e:
            if collect is None:
                raise
            collect.append(e)
            return None
    return config


def with_version(config: Config, version: str) -> Config:
    """CONFIG as release VERSION (`build --version`), checked like appliance.version."""
    if not _VERSION.fullmatch(version):
        raise ConfigError(f"--version {version!r}: invalid", hint="expected numbers joined by dots, e.g. 1.4.0")
    return dataclasses.replace(config, appliance=dataclasses.replace(config.appliance, version=version))


def _cross_checks(path: Path, config: Config) -> None:
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
    if offload is not None and ((gib := parse_decimal(offload)) is None or gib > MAX_GIB):
        raise ConfigError(
            f"{path}: engine.args has --kv-offloading-size {offload!r}",
            hint=f"a size in GiB written with ASCII digits, e.g. 96 or 0.5, at most {MAX_GIB:g}",
        )
    if config.gpu.required and config.profile == "demo":
        raise ConfigError(f"{path}: profiles.demo needs gpu.required = false", hint="the demo runs without a GPU")


# ----------------------------------------------------------------------------------- on the device

# Values Config.to_json() adds for readers that are not Python; on loading they must equal what
# the model derives, so the file cannot say two different things.
_DERIVED: dict[tuple[str, str], Callable[[Config], Any]] = {
    ("engine", "reference"): lambda c: c.engine.reference,
    ("engine", "offload_gib"): lambda c: c.engine.offload_gib,
    ("engine", "served_model_name"): lambda c: c.engine.served_model_name,
    ("model", "snapshot_path"): lambda c: c.model.snapshot_path,
    ("model", "weights_dir"): lambda c: c.model.weights_dir,
}
DEVICE_HINT = "the image is damaged; reinstall or roll back"


def device_path() -> Path:
    """The image's configuration (Config.to_json() of the build); APPLIANCE_CONFIG moves it for tests."""
    from appliance import paths

    return Path(os.environ.get("APPLIANCE_CONFIG", str(paths.CONFIG_JSON)))


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number here")


def from_json(data: Any, path: Path) -> Config:
    """DATA (parsed appliance.json) as the model, through the same loader as appliance.toml."""
    if not isinstance(data, dict) or data.get("profile") not in PROFILES:
        raise ConfigError(f"{path}: profile = {data.get('profile') if isinstance(data, dict) else data!r}: invalid", hint=DEVICE_HINT)
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k != "profile"}
    stored = {}
    for (section, key) in _DERIVED:
        if isinstance(table.get(section), dict) and key in table[section]:
            stored[(section, key)] = table[section].pop(key)
    config: Config = _Loader(path).load(Config, table, "", profile=data["profile"])
    _cross_checks(path, config)
    for (section, key), value in stored.items():
        if value != _DERIVED[(section, key)](config):
            raise ConfigError(f"{path}: {section}.{key} = {value!r} does not follow from the configuration", hint=DEVICE_HINT)
    return config


def load_image(path: Path | None = None) -> Config:
    """The image's configuration: its appliance.json as the same frozen model (no per-host settings)."""
    path = path or device_path()
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no appliance configuration",
            hint="this command runs on the appliance; set APPLIANCE_CONFIG to test elsewhere",
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})", hint=DEVICE_HINT) from None
    return from_json(data, path)


# ----------------------------------------------------------------------------------- per host

# What the signed install plan may set of the image's configuration (appliance/plan.py Plan.proxy).
HOST_SETTINGS = {"proxy": ("hostname", "allowed_cidrs", "acme_email")}
HOST_HINT = "systemctl restart appliance-host.service renders it again from the signed install plan"


def host_settings_path() -> Path:
    """Where appliance-host.service leaves the plan's settings on each boot (/run: this boot's code
    rendered them); APPLIANCE_HOST_SETTINGS moves it for tests."""
    from appliance import paths

    return Path(os.environ.get("APPLIANCE_HOST_SETTINGS", str(paths.RUN_DIR / "host-settings.json")))


def with_host_settings(config: Config, settings: Any, where: str) -> Config:
    """CONFIG with SETTINGS ({"proxy": {"hostname": ..., "allowed_cidrs": [...], "acme_email": ...}})
    in place of the image's values, checked as appliance.json is and as the Caddyfile needs: a bad
    value raises ConfigError and never reaches a reader or a file."""
    if not isinstance(settings, dict) or not set(settings) <= set(HOST_SETTINGS):
        shown = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
        raise ConfigError(f"{where}: {shown}: not per-host settings", hint=f"only {', '.join(HOST_SETTINGS)} may be set per host")
    data = config.to_json()
    for section, values in settings.items():
        if not isinstance(values, dict) or not set(values) <= set(HOST_SETTINGS[section]):
            shown = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise ConfigError(f"{where}: {section} = {shown}: not per-host settings",
                              hint=f"{section} per host: {', '.join(HOST_SETTINGS[section])}")
        data[section] = {**data[section], **values}
    # The same loader and cross-checks as the image's own file (types, patterns, acme needs an e-mail).
    merged = from_json(data, Path(where))
    from appliance import caddyfile  # imports this module

    try:
        caddyfile.template_values(merged)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.message}", hint=e.hint) from None
    return merged


def load_device(path: Path | None = None, settings: Path | None = None) -> Config:
    """The device's configuration: the image's, with the per-host settings of the signed install
    plan (SETTINGS, written by appliance-host.service after it verified the plan) where there are."""
    config = load_image(path)
    settings = settings or host_settings_path()
    try:
        data = json.loads(settings.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        return config
    except (OSError, ValueError) as e:
        raise ConfigError(f"{settings}: not valid JSON ({e})", hint=HOST_HINT) from None
    return with_host_settings(config, data, str(settings))
