"""The configuration model: appliance.toml parsed into frozen dataclasses.

One table of dataclasses describes every setting; a single generic loader walks it, so unknown
keys, wrong types and bad values are all reported the same way: one line naming the file, the
key and the value, and a hint. Everything the build produces is derived from `Config`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import ConfigError

PROFILES = ("production", "demo")

# ----------------------------------------------------------------------------------- checks
# Each check returns None when the value is good, else a hint saying what a good value is.

Check = Callable[[Any], str | None]

_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REVISION = re.compile(r"^[0-9a-f]{40}$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,3}$")
_IMAGE_NAME = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CAPABILITY = re.compile(r"^[A-Z_]+$")
_SIZE = re.compile(r"^[0-9]+[kmg]$")
_URL_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*$")
_SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com) [A-Za-z0-9+/=]+( [^\n\r]*)?$")
# Characters that would let a value break out of a line in a generated unit, Caddyfile or
# sources file.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f{}\"'`$\\;]")


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
    if not value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value:
        return "an absolute path without '..', spaces or quotes, e.g. /opt/aiter-configs/table.csv"
    return None


def _is_repo_file(value: str) -> str | None:
    parts = value.split("/")
    if value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value or not value:
        return "a path relative to the project root, without '..', e.g. overlays/demo/file.py"
    return None


def _is_url(value: str) -> str | None:
    if value == "":
        return None
    if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~/-]*)?", value):
        return "an http(s) URL such as https://updates.example.net/appliance/, or \"\""
    return None


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


def _positive(value: float) -> str | None:
    return None if value > 0 else "a number greater than 0"


def _port(value: int) -> str | None:
    return None if 0 < value < 65536 else "a TCP port between 1 and 65535"


def _check(fn: Check) -> dict[str, Check]:
    return {"check": fn}


def _each(fn: Check) -> dict[str, Check]:
    """Metadata for a tuple field: check every element."""
    return {"each": fn}


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
    interval_s: int = field(default=30, metadata=_check(_positive))
    timeout_s: int = field(default=5, metadata=_check(_positive))
    retries: int = field(default=5, metadata=_check(_positive))
    start_period_s: int = field(default=1200, metadata=_check(_positive))


@dataclass(frozen=True)
class Shm:
    margin_gib: float = field(default=8.0, metadata=_check(_positive))


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
        metadata=_check(lambda v: None if v == "unlimited" or v.isdigit() else "'unlimited' or a number of bytes"),
    )
    security_opt: tuple[str, ...] = field(
        default=(), metadata=_each(_one_of("seccomp=unconfined", "label=disable", "no-new-privileges"))
    )
    stop_timeout_s: int = field(default=120, metadata=_check(_positive))
    log_max_size: str = field(default="100m", metadata=_check(_pattern(_SIZE, "a size such as 100m")))
    log_max_files: int = field(default=5, metadata=_check(_positive))
    aiter_cache_dir: str = field(default="/var/lib/appliance/aiter", metadata=_check(_is_abs_path))
    crash_dir: str = field(default="/var/crash/vllm", metadata=_check(_is_abs_path))
    env: Mapping[str, str] = field(default_factory=dict, metadata=_each(_is_env_value))
    health: Health = field(default_factory=Health)
    shm: Shm = field(default_factory=Shm)
    overlays: tuple[PinnedFile, ...] = ()
    tuning: tuple[PinnedFile, ...] = ()

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
        """CPU KV offload size (GiB), read from the engine's own --kv-offloading-size."""
        value = self.arg_value("--kv-offloading-size")
        return float(value) if value else 0.0

    @property
    def served_model_name(self) -> str | None:
        return self.arg_value("--served-model-name")


@dataclass(frozen=True)
class Expected:
    model_memory_gib: float | None = None
    draft_params: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    offload_mmap_gb: float | None = None


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
    assessment_deadline_s: int = field(default=3600, metadata=_check(_positive))


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

    def to_json(self) -> dict[str, Any]:
        """The configuration as the device reads it (/usr/lib/appliance/appliance.json)."""
        data = _plain(self)
        assert isinstance(data, dict)
        data["engine"]["reference"] = self.engine.reference
        data["engine"]["offload_gib"] = self.engine.offload_gib
        data["engine"]["served_model_name"] = self.engine.served_model_name
        data["model"]["snapshot_path"] = self.model.snapshot_path
        data["model"]["weights_dir"] = self.model.weights_dir
        return data


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "a list of " + _type_name(typing.get_args(tp)[0]) + "s"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp) or origin is Mapping:
        return "a table"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


class _Loader:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, value: Any, hint: str) -> typing.NoReturn:
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        raise ConfigError(f"{self.path}: {key} = {shown}: invalid", hint=f"expected {hint}")

    def value(self, tp: Any, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
        origin = typing.get_origin(tp)
        if origin in (types.UnionType, typing.Union):
            if value is None:
                return None
            (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
            return self.value(inner, value, key, meta)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                self.fail(key, value, "a table")
            return self.dataclass(typing.cast(type, tp), value, key)
        if origin is tuple:
            (inner,) = typing.get_args(tp)[:1]
            if not isinstance(value, list):
                self.fail(key, value, _type_name(tp))
            each = {"check": meta["each"]} if "each" in meta else {}
            return tuple(self.value(inner, v, f"{key}[{i}]", each) for i, v in enumerate(value))
        if origin is Mapping:
            if not isinstance(value, dict):
                self.fail(key, value, "a table of strings")
            out = {}
            for k, v in value.items():
                if not _ENV_NAME.match(k):
                    self.fail(f"{key}.{k}", v, "a name of letters, digits and '_'")
                each = {"check": meta["each"]} if "each" in meta else {}
                out[k] = self.value(str, v, f"{key}.{k}", each)
            return types.MappingProxyType(out)
        ok = isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            self.fail(key, value, _type_name(tp))
        check = meta.get("check")
        if check is not None and (hint := check(value)) is not None:
            self.fail(key, value, hint)
        return value

    def dataclass(self, cls: type, table: dict[str, Any], prefix: str, **given: Any) -> Any:
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in table:
            if key not in fields or key == "profile":
                known = ", ".join(n for n in fields if n != "profile")
                raise ConfigError(
                    f"{self.path}: unknown key {_join(prefix, key)!r}", hint=f"known keys here: {known}"
                )
        kwargs = dict(given)
        for name, f in fields.items():
            if name in given:
                continue
            key = _join(prefix, name)
            if name in table:
                kwargs[name] = self.value(hints[name], table[name], key, f.metadata)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{self.path}: missing key {key!r}", hint=f"add {key} ({_type_name(hints[name])})")
        return cls(**kwargs)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


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
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}", hint="use --profile production or --profile demo")
    try:
        raw = tomllib.loads(path.read_text())
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
    config: Config = _Loader(path).dataclass(Config, raw, "", profile=profile)
    _cross_checks(path, config)
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
    if config.gpu.required and config.profile == "demo":
        raise ConfigError(f"{path}: profiles.demo needs gpu.required = false", hint="the demo runs without a GPU")
