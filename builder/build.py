"""Build the appliance image: check, generate, run mkosi, and move the result into place.

Everything is written under a temporary path first; only a build that succeeded replaces the
previous output, so a failed build leaves the previous image untouched.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from builder import engine_image, mirror, render
from builder.config import Config
from builder.errors import UserError
from builder.run import HOST_CACHE, mkosi_command, run

log = logging.getLogger("builder")

ROOT = render.ROOT
IMAGE_DIR = ROOT / "image"
MKOSI_CACHE = HOST_CACHE / "mkosi-cache"


@dataclass(frozen=True)
class BuildResult:
    output_dir: Path
    disk_image: Path
    version: str
    seconds: float


def work_dir(config: Config) -> Path:
    return ROOT / "build" / config.profile


def output_dir(config: Config) -> Path:
    return ROOT / "out" / config.profile


def write_sandbox(config: Config, sandbox: Path) -> None:
    """apt sources for mkosi and its tools tree, derived from the host (or appliance.toml)."""
    mirrors = mirror.host_mirrors()
    if config.os.mirror:
        mirrors = mirror.Mirrors(config.os.mirror, config.os.security_mirror or None)
    if mirrors is None:
        raise UserError(
            "no Debian archive found in the host's apt configuration",
            hint="set os.mirror in appliance.toml to a Debian archive URL",
        )
    sources = sandbox / "etc/apt/sources.list.d/mkosi.sources"
    sources.parent.mkdir(parents=True, exist_ok=True)
    sources.write_text(mirror.sources_deb822(mirrors, config.os.release, ("main", "non-free-firmware")))


def mkosi_arguments(config: Config, generated: Path, sandbox: Path, out: Path) -> list[str]:
    """The options the builder adds to image/mkosi.conf; `make bench` runs plain mkosi with the same."""
    MKOSI_CACHE.mkdir(parents=True, exist_ok=True)
    return [
        "-C", str(IMAGE_DIR),
        f"--extra-tree={generated}",
        f"--sandbox-tree={sandbox}",
        f"--tools-tree-sandbox-tree={sandbox}",
        f"--cache-directory={MKOSI_CACHE}",
        f"--output-directory={out}",
        f"--image-version={config.appliance.version}",
        f"--hostname={config.os.hostname}",
    ]


def _replace_dir(new: Path, final: Path) -> None:
    """Swap NEW into FINAL's place; the old FINAL is removed only after the swap."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def prepare(config: Config, engine_source: Path | None = None) -> tuple[Path, Path]:
    """Check the inputs and generate the tree and sandbox; nothing outside build/ is touched."""
    layout = engine_image.obtain(config, engine_source)
    work = work_dir(config)
    generated, sandbox = work / "generated", work / "sandbox"
    for path in (generated, sandbox):
        shutil.rmtree(path, ignore_errors=True)
    render.generate_tree(config, generated)
    # The engine image, preloaded read-only; the engine-image unit hands it to podman.
    shutil.copytree(layout, generated / render.LIB / "engine-image")
    write_sandbox(config, sandbox)
    return generated, sandbox


def build(config: Config, extra_mkosi_args: tuple[str, ...] = (), engine_source: Path | None = None) -> BuildResult:
    started = time.monotonic()
    generated, sandbox = prepare(config, engine_source)
    final = output_dir(config)
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        run(
            [*mkosi_command(), *mkosi_arguments(config, generated, sandbox, staging), *extra_mkosi_args, "build"],
            what="mkosi build",
            hint="see mkosi's output above; run again with --debug for the full command",
        )
        disk = staging / f"appliance_{config.appliance.version}.raw"
        if not disk.is_file():
            raise UserError(f"mkosi produced no disk image at {disk}", hint="see mkosi's output above")
        # mkosi's tools tree lives in the output directory; keep it out of the result.
        shutil.rmtree(staging / "tools", ignore_errors=True)
        (staging / "build.json").write_text(
            json.dumps({"profile": config.profile, "version": config.appliance.version, "disk": disk.name}, indent=2)
            + "\n"
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _replace_dir(staging, final)
    return BuildResult(final, final / disk.name, config.appliance.version, time.monotonic() - started)
