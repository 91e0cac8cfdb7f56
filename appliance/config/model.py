# SPDX-License-Identifier: MIT
"""The configuration model: the frozen dataclasses appliance.toml and appliance.json load into.

Each field carries its check (appliance/config/checks.py) and its one description (`_doc`, from
which appliance/config/reference.py generates docs/configuration.md's reference and
docs/appliance.example.toml); the values the build and the device derive from the settings are
properties here. `cross_checks` holds the rules that tie settings together; `ConfigLoader` words
the schema loader's faults (appliance.toml, appliance.json, the plan).
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


def _doc(text: str, **more: Any) -> dict[str, Any]:
    """Field metadata: the setting's one description, from which docs/configuration.md and
    docs/appliance.example.toml are generated (appliance/config/reference.py). `example` is a value
    the example shows where the default cannot (a required setting, a list that is empty)."""
    return {"doc": text, **more}


@dataclass(frozen=True)
class Appliance:
    name: str = field(metadata=_check(checks.is_dns_name)
                      | _doc("The appliance's name, on the console and in applianctl status.", example="dsv4-flash"))
    version: str = field(metadata=_check(checks.pattern(VERSION, f"{VERSION_FORM}, e.g. 1.4.0"))
                         | _doc("The release version this build makes (the builder's build --version overrides it); "
                                "an appliance updates only to a newer one.", example="1.0.0"))
    min_version: str = field(default="0", metadata=_check(checks.pattern(VERSION, f"{VERSION_FORM}, e.g. 1.0.0"))
                             | _doc("The oldest version a release bundle of this build may be installed over; \"0\": any."))


@dataclass(frozen=True)
class Os:
    release: str = field(metadata=_check(checks.one_of("trixie")) | _doc("The Debian release the image is built from.", example="trixie"))
    mirror: str = field(default="", metadata=_check(checks.is_url) | _doc(
        "The Debian archive's URL; \"\": the build host's apt configuration's (no archive host name is written in this "
        "repository), which the builder gives mkosi as a sources file of its own."))
    security_mirror: str = field(default="", metadata=_check(checks.is_url) | _doc(
        "The Debian security archive's URL; \"\": the build host's apt configuration's."))
    hostname: str = field(default="appliance", metadata=_check(checks.is_dns_name) | _doc("The host name the appliance boots with."))
    ssh_authorized_keys: tuple[str, ...] = field(default=(), metadata=_each(checks.is_ssh_key) | _doc(
        "The OpenSSH public keys that may log in over SSH, the only way in over the network (there is no password login); "
        "none: SSH is off."))
    secure_boot_microsoft_ca: bool = field(default=True, metadata=_doc(
        "Whether Secure Boot's allowed-signatures list (db) also holds Microsoft's third-party UEFI CAs (2011, 2023) and "
        "Option ROM CA (2023), which sign the option ROMs of NICs, RAID controllers and GPUs: without them a server may "
        "not bring up its devices under Secure Boot. false: only the appliance's own certificate (check first that the "
        "server boots its devices without them; docs/security.md)."))
    device_timeout_sec: int = field(default=90, metadata=_check(checks.between(10, 3600)) | _doc(
        "Seconds systemd waits for a device (the disk holding /usr, say) before emergency mode, which reboots and uses up "
        "a boot try. It is the kernel command line's systemd.default_device_timeout_sec=, signed into the kernel image: "
        "under Secure Boot nothing else reaches the command line."))
    amdgpu: str = field(default="inbox", metadata=_check(checks.one_of("inbox", "dkms")) | _doc(
        "The GPU's kernel driver: \"inbox\" is Debian's amdgpu, in the kernel the image signs. \"dkms\" (AMD's "
        "amdgpu-dkms) is refused at build: under Secure Boot Debian's kernel would not load its modules "
        "(docs/architecture.md, \"The GPU driver\")."))
    amdgpu_dkms_package: str = field(default="", metadata=_check(lambda v: None if v == "" else checks.is_repo_file(v)) | _doc(
        "With amdgpu = \"dkms\" only: AMD's amdgpu-dkms package, a file of this repository."))
    amdgpu_dkms_sha256: str = field(
        default="", metadata=_check(lambda v: None if v == "" or SHA256.fullmatch(v) else "64 lower-case hex digits")
        | _doc("With amdgpu = \"dkms\" only: the package's SHA-256.")
    )


@dataclass(frozen=True)
class Model:
    id: str = field(metadata=_check(checks.pattern(MODEL_ID, "a Hugging Face model id, e.g. deepseek-ai/DeepSeek-V4-Flash-0731"))
                    | _doc("The model's Hugging Face id.", example="deepseek-ai/DeepSeek-V4-Flash-0731"))
    revision: str = field(metadata=_check(checks.pattern(REVISION, "a full commit hash: 40 lower-case hex digits"))
                          | _doc("The model's revision: the commit of its Hugging Face repository.",
                                 example="7872f01b1d1fe23eabc4c98b48bffcef5a386062"))
    cache_dir: str = field(default="/var/lib/appliance/huggingface", metadata=_check(checks.is_abs_path) | _doc(
        "The Hugging Face cache on /var that holds the weights, mounted read-only in the engine at /root/.cache/huggingface."))
    weights_manifest: str = field(default="", metadata=_check(lambda v: None if v == "" else checks.is_repo_file(v)) | _doc(
        "The signed weights manifest (python3 -m builder weights pin makes it), a file of this repository: every weight "
        "file is fetched and checked against it before each engine start (docs/weights.md). \"\": none is shipped and the "
        "weights are not checked."))
    source: str = field(default="", metadata=_check(checks.is_weights_source) | _doc(
        "Where applianctl model fetch gets the weights by default: an https:// mirror or a directory; \"\": none."))

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

    file: str = field(metadata=_check(checks.is_repo_file) | _doc("The file, relative to this repository's root; SHA256SUMS pins it."))
    target: str = field(metadata=_check(checks.is_abs_path) | _doc("Where it is mounted, read-only, in the engine's container."))
    sha256: str = field(
        default="", metadata=_check(lambda v: None if v == "" or SHA256.fullmatch(v) else "64 lower-case hex digits")
        | _doc("Its SHA-256, which must equal its line in SHA256SUMS; \"\": SHA256SUMS alone pins it.")
    )


@dataclass(frozen=True)
class Health:
    path: str = field(default="/health", metadata=_check(checks.pattern(checks.URL_PATH, "a URL path such as /health")) | _doc(
        "The engine's readiness path, asked on loopback by the health check, the probes and the proxy."))
    interval_s: int = field(default=30, metadata=_check(checks.between(1, 86400)) | _doc("Seconds between two health checks."))
    timeout_s: int = field(default=5, metadata=_check(checks.between(1, 86400)) | _doc("Seconds one health check may take."))
    retries: int = field(default=5, metadata=_check(checks.between(1, 1000)) | _doc(
        "Failed checks in a row after which a running engine counts as unhealthy."))
    start_period_s: int = field(default=1200, metadata=_check(checks.between(1, 7 * 86400)) | _doc(
        "Seconds a starting engine has to become healthy (load the model, capture its graphs) before systemd gives the "
        "start up."))


@dataclass(frozen=True)
class Shm:
    margin_gib: float = field(
        default=8.0,
        metadata=_check(
            lambda v: None if 0 < v <= checks.MAX_GIB else f"a number greater than 0, at most {checks.number_text(checks.MAX_GIB)}"
        )
        | _doc("GiB of /dev/shm beyond every replica's CPU KV offload file (--kv-offloading-size in engine.args): /dev/shm "
               "is sized to both, and must have them free before the engines start.")
    )


@dataclass(frozen=True)
class Remediation:
    quiet_s: int = field(default=86400, metadata=_check(checks.between(600, 30 * 86400)) | _doc(
        "Seconds without a hive-wide fault (an amdgpu reset or RAS fault in the kernel log, several replicas dying "
        "together) after which the remediation ladder starts again from its first step. \"Needs physical action\" "
        "is not cleared by time: only by someone who looked (applianctl/judge/hive.py)."))
    restarts: int = field(default=1, metadata=_check(checks.between(0, 10)) | _doc(
        "Hive-wide faults met by restarting the replicas (staggered, each after its GPU self-test); the next one "
        "reboots the machine once, and one after that stops the replicas: needs physical action."))
    settle_s: int = field(default=300, metadata=_check(checks.between(10, 3600)) | _doc(
        "The ladder's rate limit: for this many seconds after a counted fault, more evidence (a reset's further "
        "lines, the other replicas dying) is the same fault, not the next step."))
    together_replicas: int = field(default=2, metadata=_check(checks.between(2, 64)) | _doc(
        "Replicas that exit within together_s of one another count as one hive-wide fault (with fewer replicas, "
        "only the kernel log tells one)."))
    together_s: int = field(default=30, metadata=_check(checks.between(1, 600)) | _doc(
        "See together_replicas."))


@dataclass(frozen=True)
class Progress:
    """The progress judge's bounds (appliance-judge.service, applianctl/judge/): a replica is alive
    while its token counters move, or a one-token canary answers when they do not."""

    interval_s: int = field(default=5, metadata=_check(checks.between(1, 60)) | _doc(
        "Seconds between two rounds of the judge: each replica's /metrics read, its unit's state asked of systemd."))
    stall_after_s: int = field(default=180, metadata=_check(checks.between(10, 3600)) | _doc(
        "Seconds without a token (vLLM's generation and prompt token counters frozen, no canary answered) while "
        "requests are waiting or running, by which a replica is stalled: taken out of the balancer, killed and "
        "restarted (the judge sees a replica once a round, so it decides after stall_after_s - 2 x interval_s of "
        "silence it saw). Longer than the longest prefill: with chunked prefill the other streams keep generating, and a "
        "prompt alone at --max-model-len (262144 tokens in 2048-token chunks, 128 steps) shows its tokens only "
        "once its prefill ends."))
    canary_after_s: int = field(default=60, metadata=_check(checks.between(5, 3600)) | _doc(
        "Seconds without a token after which the judge sends the replica a one-token completion (the canary), "
        "idle or not; a moving counter sends none, so a busy appliance gets none and an idle one about "
        "3600 / canary_after_s an hour per replica."))
    canary_timeout_s: int = field(default=30, metadata=_check(checks.between(1, 600)) | _doc(
        "Seconds the canary may take. One that gets no answer while the replica has nothing else in flight "
        "(an engine core frozen while idle), or one answered with a server error, stalls the replica at once; "
        "on a busy replica a slow canary is no verdict (it queues behind the batch), stall_after_s decides."))


# Set in every engine's environment whatever engine.env says (engine.env may only repeat them).
FIXED_ENV = {"PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class Engine:
    image: str = field(metadata=_check(checks.pattern(checks.IMAGE_NAME, "an image name without tag, e.g. vllm/vllm-openai-rocm"))
                       | _doc("The engine's container image, without tag.", example="vllm/vllm-openai-rocm"))
    digest: str = field(metadata=_check(checks.pattern(DIGEST, "'sha256:' followed by 64 lower-case hex digits")) | _doc(
        "The image's digest: the build fetches the image by it and ships it as a dm-verity store.",
        example="sha256:e68d18b2ba50298661bfc49baf01158fbf036645c2362cccf3e8a7a79fe6c69a"))
    args: tuple[str, ...] = field(metadata=_each(checks.is_arg) | _doc(
        "The engine's arguments, after serve and the model's path. --port must equal port; --tensor-parallel-size, if "
        "given, the layout's tensor parallel size; --data-parallel-size is refused (replicas are separate engines: "
        "topology.layout); --kv-offloading-size (GiB) sizes /dev/shm.",
        example=("--host", "0.0.0.0", "--port", "8000", "--max-model-len", "262144")))
    entrypoint: tuple[str, ...] = field(default=("vllm",), metadata=_each(checks.is_arg) | _doc(
        "What the image runs; serve, the model's path and args follow."))
    volumes: tuple[str, ...] = field(default=(), metadata=_each(checks.is_volume) | _doc(
        "Extra read-only host mounts, HOST:CONTAINER (the demo's stand-in borrows the OS's Python)."))
    port: int = field(default=8000, metadata=_check(checks.is_port) | _doc(
        "The first replica's loopback port; replica i listens on port + 2 x i."))
    init: bool = field(default=True, metadata=_doc("Whether the container runs an init process that reaps the engine's children."))
    ipc: str = field(default="host", metadata=_check(checks.one_of("host", "private")) | _doc(
        "The container's IPC namespace: the host's, or a private one."))
    devices: tuple[str, ...] = field(default=(), metadata=_each(checks.is_abs_path) | _doc(
        "The device nodes the container gets (/dev/kfd and /dev/dri for the GPUs); with several replicas /dev/dri is "
        "narrowed to each replica's own GPUs' render nodes."))
    capabilities: tuple[str, ...] = field(
        default=(), metadata=_each(checks.pattern(checks.CAPABILITY, "a capability name without CAP_, e.g. SYS_PTRACE"))
        | _doc("The Linux capabilities the container gets.")
    )
    memlock: str = field(
        default="unlimited",
        metadata=_check(
            lambda v: None if v == "unlimited" or (re.fullmatch(r"[0-9]{1,18}", v) and int(v) > 0) else "'unlimited' or a number of bytes"
        ) | _doc("How much memory the engine may lock, in bytes."),
    )
    security_opt: tuple[str, ...] = field(
        default=(), metadata=_each(checks.one_of("seccomp=unconfined", "label=disable", "no-new-privileges"))
        | _doc("podman's security options: no seccomp filter, no SELinux labels, no new privileges.")
    )
    stop_timeout_s: int = field(default=120, metadata=_check(checks.between(1, 86400)) | _doc(
        "Seconds a stopping engine gets to finish the requests in flight before it is killed."))
    log_max_size: str = field(default="100m", metadata=_check(checks.pattern(checks.SIZE, "a size such as 100m")) | _doc(
        "With log_max_files, the bound of the local journal: log_max_size x log_max_files (journald's SystemMaxUse=)."))
    log_max_files: int = field(default=5, metadata=_check(checks.between(1, 1000)) | _doc("See log_max_size."))
    aiter_cache_dir: str = field(default="/var/lib/appliance/aiter", metadata=_check(checks.is_abs_path) | _doc(
        "AITER's kernel cache on /var, mounted at /root/.aiter in the engine, so that compiled kernels outlive a restart."))
    crash_dir: str = field(default="/var/crash/vllm", metadata=_check(checks.is_abs_path) | _doc(
        "Where the engine's crash dumps land on /var, mounted at /var/crash/vllm in the engine."))
    env: Mapping[str, str] = field(
        default_factory=dict,
        metadata={
            **_each(checks.is_env_value),
            "keys": lambda k: None if checks.ENV_NAME.match(k) else "a name of letters, digits and '_'",
        } | _doc("The engine's environment, NAME = \"value\". Every engine also runs with PYTHONHASHSEED=0 (so that every "
                 "replica hashes prompts' prefix blocks alike), which this may only repeat.",
                 example={"VLLM_ROCM_USE_AITER": "1"}),
    )
    health: Health = field(default_factory=Health, metadata=_doc(
        "The engine's health check (podman's), on the engine's own readiness path."))
    shm: Shm = field(default_factory=Shm, metadata=_doc("/dev/shm, where every replica maps its CPU KV offload file."))
    progress: Progress = field(default_factory=Progress, metadata=_doc(
        "The progress judge: each replica is judged alive by its tokens, not by /health (a readiness signal that "
        "stays 200 while a deadlocked engine core serves nothing)."))
    remediation: Remediation = field(default_factory=Remediation, metadata=_doc(
        "Hive-wide GPU faults: restart, then one reboot, then stop and report \"needs physical action\"."))
    overlays: tuple[PinnedFile, ...] = field(default=(), metadata=_doc(
        "Python files of this repository mounted read-only over files in the engine's container. The production ones "
        "are third-party code the operator puts in overlays/production/.",
        example=(PinnedFile("overlays/production/fused_moe.py", "/usr/local/lib/python3.12/dist-packages/vllm/fused_moe.py"),)))
    tuning: tuple[PinnedFile, ...] = field(default=(), metadata=_doc(
        "AITER GEMM tuning tables mounted read-only in the engine's container, supplied like the overlays.",
        example=(PinnedFile("tuning/production/gemm.csv", "/opt/aiter-configs/gemm.csv"),)))
    slot_size_gib: float = field(default=40.0, metadata=_check(checks.is_slot_size) | _doc(
        "The size of each of the two engine slots (GiB, a whole number of MiB): the partitions that hold the engine "
        "image's store, one running, one for the next engine (docs/disk-layout.md). Fixed when a disk is installed, so it "
        "must hold every engine image this appliance will run; a build refuses an image that does not fit."))

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
    model_memory_gib: float | None = field(default=None, metadata=_check(checks.between(0, checks.MAX_GIB)) | _doc(
        "GiB the model takes on the GPU (\"Model loading took N GiB\").", example=156.67))
    draft_params: int | None = field(default=None, metadata=_check(checks.between(0, 10**15)) | _doc(
        "The speculative draft model's parameters (\"DSpark draft model loaded: N params\").", example=96))
    kv_cache_tokens: int | None = field(default=None, metadata=_check(checks.between(0, 10**15)) | _doc(
        "Tokens the GPU KV cache holds (\"GPU KV cache size: N tokens\").", example=1927444))
    max_concurrency: float | None = field(default=None, metadata=_check(checks.between(0, 10**9)) | _doc(
        "Requests of the full length the engine can serve at once (\"Maximum concurrency for ... tokens per request: Nx\").",
        example=7.35))
    offload_mmap_gb: float | None = field(default=None, metadata=_check(checks.between(0, checks.MAX_GIB)) | _doc(
        "GB of the CPU KV offload file (\"Created mmap file ... (N GB)\").", example=103.08))


@dataclass(frozen=True)
class Gpu:
    required: bool = field(default=True, metadata=_doc(
        "Whether the appliance needs GPUs: without one, status's gpu part is down (false: \"not configured\", as in the "
        "demo, which must say false)."))
    min_vram_headroom_mib: int = field(default=1024, metadata=_check(checks.positive) | _doc(
        "MiB of VRAM that should stay free after warm-up: applianctl status warns below it (a few hundred MB left may "
        "start, then fail on the first request)."))


@dataclass(frozen=True)
class Proxy:
    hostname: str = field(metadata=_check(checks.is_dns_name) | _doc(
        "The name clients reach the appliance by; the proxy's certificate is for it.", example="appliance.example.net"))
    tls: str = field(default="internal", metadata=_check(checks.one_of("internal", "acme")) | _doc(
        "Where the proxy's certificate comes from: \"internal\", the appliance's own CA; \"acme\", an ACME CA, for a "
        "public name (with acme_email)."))
    acme_email: str = field(
        default="", metadata=_check(lambda v: None if v == "" or checks.EMAIL.fullmatch(v) else "an e-mail address such as ops@example.net")
        | _doc("The ACME account's e-mail address, needed with tls = \"acme\".")
    )
    https_port: int = field(default=443, metadata=_check(checks.is_port) | _doc("The port the proxy serves HTTPS on."))
    http: str = field(default="redirect", metadata=_check(checks.one_of("redirect", "close")) | _doc(
        "Plain HTTP on port 80: \"redirect\" to HTTPS, or \"close\"."))
    allowed_cidrs: tuple[str, ...] = field(default=("127.0.0.1/32",), metadata=_each(checks.is_cidr) | _doc(
        "The networks requests may come from. A request reaches the engine only from these sources and on allowed_paths; "
        "all else gets 403."))
    allowed_paths: tuple[str, ...] = field(
        default=("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/generate"),
        metadata=_each(checks.pattern(checks.URL_PATH, "a URL path such as /v1/models")) | _doc(
            "The URL paths requests may ask for (with any query)."),
    )
    metrics_cidrs: tuple[str, ...] = field(default=(), metadata=_each(checks.is_cidr) | _doc(
        "When /metrics is an allowed path: the only networks, of those allowed, that may read it; empty: every allowed one."))
    affinity_header: str = field(default="", metadata=_check(checks.is_header_name) | _doc(
        "With several replicas (topology.layout): requests that carry this header go to the replica its value hashes to, "
        "so that a conversation's turns reuse that replica's prefix cache; the others to the replica with the fewest "
        "requests in flight. \"\": no affinity."))


@dataclass(frozen=True)
class Metrics:
    """The metrics site (node_exporter's and the engine's metrics behind the proxy); each setting's
    description is on its field."""

    port: int = field(default=9443, metadata=_check(checks.is_port) | _doc(
        "The metrics site's HTTPS port: not the proxy's, the engine's or 80."))
    allowed_cidrs: tuple[str, ...] = field(default=(), metadata=_each(checks.is_cidr) | _doc(
        "Who may scrape, besides the appliance itself; empty: no one from the network."))
    client_ca: str = field(default="", metadata=schema.multiline(checks.is_pem_certificates) | _doc(
        "PEM CA certificates: a scraper must also present a client certificate one of them signed; \"\": none is asked."))
    refresh_s: int = field(default=60, metadata=_check(checks.between(15, 3600)) | _doc(
        "Seconds between two refreshes of the status and GPU gauges (each one applianctl status run)."))


@dataclass(frozen=True)
class Logs:
    """Where the journal goes (systemd-journal-upload); each setting's description is on its field."""

    upload_url: str = field(default="", metadata=_check(checks.is_https_url) | _doc(
        "The collector's URL, e.g. https://logs.example.net:19532; \"\": the journal stays on the box."))
    upload_ca: str = field(default="", metadata=schema.multiline(checks.is_pem_certificates) | _doc(
        "PEM: the CA that signed the collector's certificate, needed with upload_url."))


DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True)
class MaintenanceWindow:
    """When the update timer may install and reboot (appliance/rollout.py judges it)."""

    start: str = field(metadata=_check(checks.pattern(re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]\Z"), "a time of day HH:MM (UTC)"))
                       | _doc("When the window opens, UTC."))
    duration_min: int = field(metadata=_check(checks.between(1, 1440)) | _doc(
        "How long it stays open, in minutes; it may run past midnight."))
    days: tuple[str, ...] = field(default=DAYS, metadata=_each(checks.one_of(*DAYS)) | _doc("The days it opens on."))

    @property
    def start_min(self) -> int:
        hours, minutes = self.start.split(":")
        return int(hours) * 60 + int(minutes)


@dataclass(frozen=True)
class Update:
    url: str = field(default="", metadata=_check(checks.is_url) | _doc(
        "Where the daily update timer looks for a newer release (a bundle or a channel index); \"\": no automatic check."))
    assessment_deadline_s: int = field(default=3600, metadata=_check(checks.between(1, 7 * 86400)) | _doc(
        "Seconds a newly installed version has to serve the smoke completion through the proxy before it is rolled back."))
    boot_tries: int = field(default=3, metadata=_check(checks.between(1, 20)) | _doc(
        "Boots a newly installed version gets to be judged good before systemd-boot falls back to the previous one (each "
        "boot that fails the assessment, panics or hangs uses one)."))
    timer_action: str = field(default="install", metadata=_check(checks.one_of("install", "download-only")) | _doc(
        "What the update timer does with a newer bundle at url: \"install\" it into the inactive slot (it boots at the "
        "next reboot), or \"download-only\": fetch and verify it into /var, to install later, in a maintenance window, "
        "with applianctl update --apply --reboot."))
    maintenance_windows: tuple[MaintenanceWindow, ...] = field(default=(), metadata=_doc(
        "When the update timer may install from a channel and reboot; none: any time.",
        example=(MaintenanceWindow("22:00", 240, ("sat", "sun")),)))


@dataclass(frozen=True)
class Topology:
    """The GPUs and how the engines share them. Replicas are separate engines because vLLM's data
    parallelism would make one failure domain of a mixture-of-experts model. cross_checks ties it to
    the engine's arguments and /dev/shm; `check_host` to a host."""

    gpus: int = field(default=1, metadata=_check(checks.between(1, checks.MAX_GPUS)) | _doc(
        "How many GPUs the appliance serves with."))
    layout: str = field(default="1x1", metadata=_check(checks.is_layout) | _doc(
        "R replicas (separate engines) of T GPUs each, in tensor parallel; R x T must equal gpus. Replica i takes GPUs "
        "i x T to i x T + T - 1."))
    memory_gib: float = field(default=0.0, metadata=_check(checks.between(0, checks.MAX_GIB)) | _doc(
        "The host's memory (MemTotal, GiB) this build is for: every replica's CPU KV offload file, engine.shm.margin_gib "
        "and memory_reserve_gib must fit in it, or the build refuses the layout. 0: checked only at boot, against the "
        "real host."))
    memory_reserve_gib: float = field(default=32.0, metadata=_check(checks.between(0, checks.MAX_GIB)) | _doc(
        "GiB of memory kept beside /dev/shm for the OS and the engines' own processes."))
    stagger_s: int = field(default=300, metadata=_check(checks.between(0, 3600)) | _doc(
        "Staggered starts, so that the replicas do not all read the weights from one disk at once: replica i starts once "
        "replica i-1 is healthy, and at the latest i x stagger_s seconds after it was started. 0: all at once."))

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
    profile: str  # set by the loader (the profile asked for), never read from the file
    appliance: Appliance = field(metadata=_doc("The release: its name and version."))
    os: Os = field(metadata=_doc("The image's Debian system."))
    model: Model = field(metadata=_doc("The model the engines serve, and where its weights live."))
    engine: Engine = field(metadata=_doc(
        "The engine: its container image, its arguments and how podman runs it, the same for every replica "
        "(docs/engine.md)."))
    proxy: Proxy = field(metadata=_doc("The TLS proxy (Caddy) in front of the engines, the only way to them from the network."))
    expected: Expected = field(default_factory=Expected, metadata=_doc(
        "The figures of a healthy start, read from the engine's log by applianctl startup-report: a start that falls short "
        "of one, or whose log lacks it, is \"degraded\". Unset: not checked."))
    gpu: Gpu = field(default_factory=Gpu, metadata=_doc("The GPUs, as applianctl status judges them."))
    update: Update = field(default_factory=Update, metadata=_doc(
        "Updates from a static update server, and how a new version is judged (docs/upgrades.md, docs/fleet.md)."))
    metrics: Metrics = field(default_factory=Metrics, metadata=_doc(
        "The appliance's own metrics (the host, its units, the status and GPU gauges; and the engine's) on a port of their "
        "own through the proxy, for scrapers, who are not clients: https://HOST:PORT/metrics and /engine/metrics "
        "(docs/fleet.md)."))
    logs: Logs = field(default_factory=Logs, metadata=_doc(
        "The journal off the box: systemd-journal-upload to a systemd-journal-remote over HTTPS, the appliance presenting "
        "a client certificate of its own."))
    topology: Topology = field(default_factory=Topology, metadata=_doc(
        "The GPUs the appliance serves with and how the engines share them (the layouts above)."))

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
            hint=f"a size in GiB written with ASCII digits, e.g. 96 or 0.5, at most {checks.number_text(checks.MAX_GIB)}",
        )
    if config.logs.upload_url and not config.logs.upload_ca:
        raise ConfigError(f"{path}: logs.upload_url needs logs.upload_ca",
                          hint="give the PEM of the CA that signed the collector's certificate")
    if config.metrics.port in (config.proxy.https_port, config.engine.port, 80):
        raise ConfigError(f"{path}: metrics.port = {config.metrics.port} is taken", hint="give the metrics a port of their own, e.g. 9443")
    _topology_checks(path, config)
    _progress_checks(path, config.engine.progress)
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


def _progress_checks(path: Path, p: Progress) -> None:
    """engine.progress's bounds against each other: a stall needs several rounds to be seen, and a
    canary must be sent and answered within the stall bound for it to count."""
    if p.stall_after_s < 3 * p.interval_s:
        raise ConfigError(f"{path}: engine.progress.stall_after_s = {p.stall_after_s} is less than 3 x interval_s ({p.interval_s})",
                          hint=f"raise stall_after_s to at least {3 * p.interval_s}, or lower interval_s")
    if p.canary_after_s < p.interval_s:
        raise ConfigError(f"{path}: engine.progress.canary_after_s = {p.canary_after_s} is less than interval_s ({p.interval_s})",
                          hint="the judge sees the counters once a round: give canary_after_s at least interval_s")
    if p.canary_after_s + p.canary_timeout_s > p.stall_after_s:
        raise ConfigError(
            f"{path}: engine.progress.canary_after_s + canary_timeout_s = {p.canary_after_s + p.canary_timeout_s} is more than "
            f"stall_after_s ({p.stall_after_s})",
            hint="a quiet replica's canary must have its answer before the stall bound: lower them or raise stall_after_s")


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
