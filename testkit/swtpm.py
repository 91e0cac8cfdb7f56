# SPDX-License-Identifier: MIT
"""A software TPM 2.0 for the tests: swtpm with an EK certificate (as a server's TPM has one from its
maker; swtpm's own local CA signs it), reached by tpm2-tools through TPM2TOOLS_TCTI.

swtpm_setup already makes the RSA EK persistent at 0x81010001. There is no resource manager between
the tools and this TPM (the device has /dev/tpmrm0): a tool that leaves a transient object loaded
uses up the TPM's few object slots, so the code under test flushes what it loaded."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from testkit.standin import free_spaced_ports

EK_HANDLE = "0x81010001"


@contextmanager
def running_swtpm(tmp: Path) -> Iterator[str]:
    """A fresh TPM whose state lives in TMP/swtpm; yields the TPM2TOOLS_TCTI string for it."""
    for tool in ("swtpm", "swtpm_setup", "tpm2_getcap"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (make setup installs swtpm, swtpm-tools and tpm2-tools)")
    state = (tmp / "swtpm").resolve()  # swtpm changes directory: every path absolute
    state.mkdir(parents=True, exist_ok=True)
    subprocess.run(["swtpm_setup", "--tpm2", "--tpmstate", str(state), "--create-ek-cert", "--create-platform-cert",
                    "--overwrite"], check=True, capture_output=True, timeout=120)
    port, ctrl = free_spaced_ports(2, 1)  # the swtpm TCTI finds the control channel at port + 1
    proc = subprocess.Popen(["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}",
                             "--server", f"type=tcp,bindaddr=127.0.0.1,port={port}",
                             "--ctrl", f"type=tcp,bindaddr=127.0.0.1,port={ctrl}",
                             "--flags", "not-need-init,startup-clear", "--log", f"file={state / 'swtpm.log'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tcti = f"swtpm:host=127.0.0.1,port={port}"
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["tpm2_getcap", "-T", tcti, "properties-fixed"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swtpm did not answer (log: {state / 'swtpm.log'})")
            time.sleep(0.2)
        yield tcti
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
