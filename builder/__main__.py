# SPDX-License-Identifier: MIT
"""python3 -m builder COMMAND: validate, build, boot and sign appliance images.

A fault the user can fix is one error line and one hint, exit status 2; tracebacks only with --debug.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import appliance.config
from appliance import cli_help, run
from appliance.errors import UserError, run_reporting

ROOT = Path(__file__).resolve().parents[1]


def _load(args: argparse.Namespace) -> appliance.config.Config:
    config = appliance.config.load(Path(args.config), args.profile)
    if getattr(args, "version", None):
        config = appliance.config.with_version(config, args.version)
    return config


def cmd_validate(args: argparse.Namespace) -> int:
    from builder import validate

    return validate.run(Path(args.config), args.profile, ROOT, debug=getattr(args, "debug", False))


def cmd_render(args: argparse.Namespace) -> int:
    """Print one generated file (e.g. the engine's quadlet) without building."""
    from builder import engine_store, proxy, render

    config = _load(args)
    names = sorted(p.name for p in render.UNITS_DIR.glob("*.j2"))
    if args.template not in names:
        raise UserError(f"no template {args.template!r}", hint="one of: " + ", ".join(names))
    if args.template == proxy.TEMPLATE:
        # Rendered (values checked and escaped) exactly as the build does.
        sys.stdout.write(proxy.render_caddyfile(config))
        return 0
    digest = config.engine.digest
    store = engine_store._load(engine_store.CACHE / digest.replace(":", "-"), digest)
    if store is None:
        # No store built yet: its root hash is a placeholder, the rest is as the build writes it.
        label = engine_store.label_for(digest)
        store = engine_store.EngineStore(Path("engine.erofs"), Path("engine.verity"), "ROOTHASH-AFTER-BUILD", label)
        if "store." in (render.UNITS_DIR / args.template).read_text():
            print(f"note: {args.template}: no engine store built yet for {digest}: its root hash is a placeholder",
                  file=sys.stderr)
    sys.stdout.write(render.render_template(args.template, config, store))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from builder import build

    config = _load(args)
    source = Path(args.engine_image) if args.engine_image else None
    result = build.build(config, tuple(args.mkosi_arg or ()), source, output=Path(args.output) if args.output else None)
    print(f"built {result.disk_image} ({config.profile} {result.version}) in {result.seconds:.0f} s")
    return 0


def cmd_boot(args: argparse.Namespace) -> int:
    from builder import build, qemu

    config = _load(args)
    disk = build.output_dir(config) / f"appliance_{config.appliance.version}.raw"
    if not disk.is_file():
        raise UserError(f"no image at {disk}", hint=f"build it first: python3 -m builder build --profile {config.profile}")
    cert = build.secure_boot_certificate(config)  # the firmware enrolls it: Secure Boot enforcing
    if args.interactive:
        return qemu.interactive(disk, cert)
    metrics_out = Path(args.metrics_out) if args.metrics_out else None
    scrape = (config.appliance.version, config.metrics.port, metrics_out) if metrics_out else None
    report = qemu.boot_and_report(disk, cert, timeout=args.timeout, scrape=scrape)
    status = report.get("status", {})
    if metrics_out is not None:
        asked = [a.get("answer", {}) for a in report.get("asked", []) if a.get("name") == "scrape"]
        if not metrics_out.is_file() or not asked:
            print(f"the metrics were not scraped ({asked[-1] if asked else 'the guest never asked'})", file=sys.stderr)
            return 1
        print(f"scraped the appliance's metrics through the proxy into {metrics_out} ({asked[-1].get('bytes')} bytes)")
    if args.status_json:
        out = Path(args.status_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=2) + "\n")
        tmp.rename(out)
    print(report.get("status_text", "").rstrip())
    failed = report.get("failed_units", [])
    if failed:
        print(f"failed units in the guest: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0 if status.get("state") == "ok" else 1


def cmd_pin(args: argparse.Namespace) -> int:
    """Re-pin on purpose: the demo's stand-in engine digest (in appliance.toml) and SHA256SUMS."""
    import re
    import tempfile

    from builder import engine_image, pins

    config = appliance.config.load(Path(args.config), "demo")
    digest = engine_image.build_standin_layout(Path(tempfile.mkdtemp()), config.engine.entrypoint)
    path = Path(args.config)
    text = path.read_text()
    head, sep, demo = text.partition("[profiles.demo.engine]")
    new_demo = re.sub(r'(?m)^digest = "sha256:[0-9a-f]{64}"', f'digest = "{digest}"', demo, count=1)
    if new_demo != demo:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(head + sep + new_demo)
        tmp.replace(path)
        print(f"{path}: demo engine digest pinned to {digest}")
    for line in pins.pin(ROOT):
        print(line)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from builder import keys

    directory = Path(args.directory) if args.directory else keys.DEFAULT_DIR
    only = args.timestamp or args.boot
    pairs = [] if only else [keys.generate(directory)]
    if args.timestamp or not only:
        pairs.append(keys.generate(directory, keys.TIMESTAMP_NAME))
    for private, public in pairs:
        print(f"private key {private} (mode 0600: keep it off the appliance and out of git)")
        print(f"public key  {public} (trusted as {keys.trusted_name(public)} by images built with this key)")
    if args.boot or not only:
        uses = {keys.SECURE_BOOT_NAME: "signs systemd-boot and the kernel images; the firmware's db trusts its certificate",
                keys.PCR_POLICY_NAME: "signs the kernel images' PCR 11 policy, which unlocks /var"}
        for name, common_name in keys.BOOT_KEYS:
            private, cert = keys.generate_x509(directory, name, common_name)
            print(f"private key {private} (mode 0600; {uses[name]})")
            print(f"certificate {cert}")
    return 0


def project_version() -> str:
    """The project's version (pyproject.toml beside builder/)."""
    import tomllib

    try:
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"
    return version if isinstance(version, str) else "unknown"


class _Parser(argparse.ArgumentParser):
    """Remembers its arguments, so that --version sees a --config or --profile given after it."""

    argv: tuple[str, ...] = ()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.argv = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)


class _Version(argparse.Action):
    """--version: the project's version and the configuration's appliance.version, then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the builder's version and the configuration's appliance.version, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *args: object, **kw: object) -> None:
        options = argparse.ArgumentParser(prog=parser.prog, add_help=False)
        global_options(options, top=True)
        known, _ = options.parse_known_args(list(getattr(parser, "argv", ())), argparse.Namespace(**vars(namespace)))

        def report() -> int:
            try:
                config = appliance.config.load(Path(known.config), known.profile)
            except UserError:
                print(f"builder {project_version()}")  # the configuration's fault follows on stderr
                raise
            print(f"builder {project_version()}; {known.config} ({config.profile}): appliance.version {config.appliance.version}")
            return 0

        parser.exit(run_reporting(report, prefix="error: ", debug=known.debug))


def global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """Options valid before or after the command: defaults on the top parser, SUPPRESS on each
    command's parser so that an absent option does not reset them."""

    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    parser.add_argument("--debug", action="store_true", default=default(False), help="show commands and tracebacks")
    parser.add_argument("--config", default=default(str(ROOT / "appliance.toml")),
                        help="the configuration (default: appliance.toml beside builder/)")
    parser.add_argument("--profile", default=default("production"), choices=appliance.config.PROFILES,
                        help="the profile of appliance.toml to use (default: production)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python3 -m builder")
    cli_help.describe(
        parser, __doc__.splitlines()[0].split(": ", 1)[1],
        examples=["python3 -m builder --profile demo validate", "python3 -m builder --profile demo build"],
        exit_codes=[cli_help.OK, (1, "the booted image is not ok (boot)"), cli_help.FAILED_STEP],
        details="Each COMMAND's --help names its own exit statuses.",
    )
    parser.add_argument("--version", action=_Version)
    global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = cli_help.verb_parser(
        sub, "validate", "check appliance.toml without building",
        examples=["python3 -m builder validate", "python3 -m builder --profile demo validate"],
        exit_codes=[(0, "the profile is valid (one line)"), (2, "bad input, or every fault a build would refuse, each with a hint")],
    )
    p.set_defaults(func=cmd_validate)

    p = cli_help.verb_parser(
        sub, "render", "print one generated file (a template in units/)",
        examples=["python3 -m builder --profile demo render appliance-engine@.container.j2"],
        exit_codes=[(0, "printed"), cli_help.BAD_INPUT],
    )
    p.add_argument("template", help="e.g. appliance-engine@.container.j2")
    p.set_defaults(func=cmd_render)

    p = cli_help.verb_parser(
        sub, "build", "build the image into out/PROFILE/",
        examples=["python3 -m builder build", "python3 -m builder --profile demo build --version 1.4.1"],
        exit_codes=[(0, "built (the disk image's path on stdout)"), cli_help.FAILED_STEP],
    )
    p.add_argument("--mkosi-arg", action="append", help="pass an extra option to mkosi")
    p.add_argument("--engine-image", help="the engine image as an OCI layout directory or OCI archive")
    p.add_argument("--version", help="build as this release version instead of appliance.version")
    p.add_argument("--output", help="the output directory (default: out/PROFILE)")
    p.set_defaults(func=cmd_build)

    from builder import release, sign_channel

    release.add_parser(sub)
    release.add_timestamp_parser(sub)
    sign_channel.add_parser(sub)

    from builder import weights

    weights.add_parser(sub)

    from builder import installer_media, sign_plan

    sign_plan.add_parser(sub)
    installer_media.add_parsers(sub)

    from builder import installer_uki

    installer_uki.add_parser(sub)

    from builder import attest

    attest.add_parser(sub)

    from builder import recovery_key

    recovery_key.add_parser(sub)

    p = cli_help.verb_parser(
        sub, "keys", "make the release and timestamp key pairs (Ed25519), the Secure Boot and PCR policy keys (RSA)",
        examples=["python3 -m builder keys generate", "python3 -m builder keys generate --directory /secure/keys --timestamp"],
        exit_codes=[(0, "the keys are written (their paths on stdout)"), cli_help.BAD_INPUT],
    )
    p.add_argument("action", choices=["generate"], help="generate: write new key pairs")
    p.add_argument("--directory", help="where to write the keys (default: keys/, never committed)")
    p.add_argument("--timestamp", action="store_true", help="only the timestamp key pair (for a keys directory made before timestamps)")
    p.add_argument("--boot", action="store_true", help="only the Secure Boot and PCR policy keys (for an older keys directory)")
    p.set_defaults(func=cmd_keys)

    p = cli_help.verb_parser(
        sub, "pin", "rewrite SHA256SUMS and the demo engine digest on purpose",
        examples=["python3 -m builder pin"],
        exit_codes=[(0, "pinned (what changed on stdout)"), cli_help.BAD_INPUT],
    )
    p.set_defaults(func=cmd_pin)

    p = cli_help.verb_parser(
        sub, "boot", "boot the built image in QEMU and print the guest's status",
        examples=["python3 -m builder --profile demo boot", "python3 -m builder --profile demo boot --interactive"],
        exit_codes=[(0, "the guest's status is ok"),
                    (1, "it is not, a unit failed in the guest, or --metrics-out was not scraped"), cli_help.FAILED_STEP],
    )
    p.add_argument("--interactive", action="store_true", help="serial console on this terminal")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the guest's report")
    p.add_argument("--status-json", help="write the guest's status as JSON here")
    p.add_argument("--metrics-out", help="scrape the appliance's metrics through the proxy's metrics site into this file")
    p.set_defaults(func=cmd_boot)

    for command_parser in sub.choices.values():
        global_options(command_parser, top=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    run.set_debug(args.debug)
    return run_reporting(lambda: args.func(args), prefix="error: ", debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
