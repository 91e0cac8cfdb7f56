# SPDX-License-Identifier: MIT
"""The guards that make a bad version roll back by itself, each proven by what it does rather than
by a word being somewhere in a file: the boot deadline's script reboots when boot-complete.target
was not reached (and only then), the kernel command line mkosi builds arms the hardware watchdog,
and the engine cannot start unless the weights were verified."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from fakeprog import calls, fake_program

from appliance import config
from builder import engine_store, render

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "units"


def _exec_start(unit_text: str) -> str:
    """ExecStart= of UNIT_TEXT, its backslash-newline continuations joined as systemd joins them."""
    joined = re.sub(r"\\\n", " ", unit_text)
    values = [line.partition("=")[2] for line in joined.split("\n") if line.startswith("ExecStart=")]
    assert len(values) == 1, values
    return values[0]


def _run_deadline(tmp_path: Path, boot_complete_active: bool) -> list[list[str]]:
    """The boot deadline service's command as systemd runs it (/bin/sh -c SCRIPT), with a systemctl
    that answers is-active as told and records every call."""
    argv = _exec_start((UNITS / "appliance-boot-deadline.service").read_text())
    shell, _, rest = argv.partition(" -c ")
    assert shell == "/bin/sh", argv
    script = rest.strip()
    assert script[0] == script[-1] == "'", script
    bin_dir = tmp_path / "bin"
    fake_program(bin_dir, "systemctl", script_body='[ "$1" = --quiet ] && [ "$2" = is-active ] && exit "$ACTIVE"')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ACTIVE": "0" if boot_complete_active else "3"}
    subprocess.run(["/bin/sh", "-c", script[1:-1]], env=env, check=True, capture_output=True, timeout=30)
    return calls(bin_dir / "calls.log")


@pytest.mark.programs
def test_boot_deadline_reboots_a_boot_that_did_not_complete(tmp_path: Path) -> None:
    got = _run_deadline(tmp_path, boot_complete_active=False)
    assert got[-1] == ["systemctl", "reboot", "--force"], got


@pytest.mark.programs
def test_boot_deadline_leaves_a_completed_boot_alone(tmp_path: Path) -> None:
    got = _run_deadline(tmp_path, boot_complete_active=True)
    assert got == [["systemctl", "--quiet", "is-active", "boot-complete.target"]], got


def _mkosi_values(text: str, key: str) -> list[str]:
    """The words of KEY= in a mkosi config, continuation lines included, comments not."""
    words: list[str] = []
    inside = False
    for line in text.split("\n"):
        if line.lstrip().startswith("#"):
            continue  # a comment neither adds to nor ends a value
        if line.startswith(f"{key}="):
            inside = True
            line = line.partition("=")[2]
        elif not line[:1].isspace():
            inside = False
        if inside:
            words += line.split()
    return words


def _seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    m = re.fullmatch(r"([0-9]+)([a-z]*)", value)
    assert m and m.group(2) in units, value
    return int(m.group(1)) * units[m.group(2)]


def test_the_kernel_command_line_arms_the_hardware_watchdog() -> None:
    """systemd (PID 1, also in the initrd) pings the watchdog only when systemd.watchdog_sec= is on
    the kernel command line; without it a frozen PID 1 is never reset. Read from the option mkosi
    builds the command line from, so a word left in a comment does not count."""
    words = _mkosi_values((ROOT / "image/mkosi.conf").read_text(), "KernelCommandLine")
    values = [w.partition("=")[2] for w in words if w.startswith("systemd.watchdog_sec=")]
    assert len(values) == 1, words
    assert 0 < _seconds(values[0]) <= 5 * 60, values  # off is "0"; longer than 5 min is a long hang
    assert "panic=10" in words and "oops=panic" in words


def test_mkosi_value_reader_skips_comments() -> None:
    text = "[Content]\nKernelCommandLine=rw quiet\n        a=1\n# systemd.watchdog_sec=2min\n        b=2\nOther=x\n  c=3\n"
    assert _mkosi_values(text, "KernelCommandLine") == ["rw", "quiet", "a=1", "b=2"]


@pytest.mark.parametrize("profile", ["production", "demo"])
def test_the_engine_requires_the_weights_verified(profile: str) -> None:
    """Requires= and After= together: without After= systemd starts both at once, and the engine
    runs on unverified weights while the check is still reading them."""
    c = config.load(ROOT / "appliance.toml", profile)
    store = engine_store.EngineStore(Path("/x"), Path("/y"), "ab" * 32, engine_store.label_for(c.engine.digest))
    text = render.render_template("appliance-engine@.container.j2", c, store)
    unit = text.split("\n[Container]")[0]
    required = [w for line in unit.split("\n") if line.startswith("Requires=") for w in line.partition("=")[2].split()]
    after = [w for line in unit.split("\n") if line.startswith("After=") for w in line.partition("=")[2].split()]
    for needed in ("appliance-model-verify.service", "appliance-verify.service", "appliance-engine-store.service"):
        assert needed in required and needed in after, needed
    verify = (UNITS / "appliance-model-verify.service").read_text()
    # a failed check fails the unit (no "-" prefix that would ignore the exit status)
    assert _exec_start(verify).split()[0] == "/usr/bin/applianctl", verify
    assert "Type=oneshot" in verify
