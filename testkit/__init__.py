# SPDX-License-Identifier: MIT
"""Test machinery, never in a production image. Demo images (which the tests boot) carry the guest
half, installed by builder/render.py for the demo profile only: the boot check (bootcheck.py, the
entry, with boot_facts.py, boot_report.py, boot_steps.py, engine_scenarios.py and guest_commands.py)
and the units in units/ (its own, and the synthetic faults'). The rest runs on the test host: the
synthetic bad versions (faults.py) and the stand-in engine as a process (standin.py); the host
reads the boot check's report through boot_report.py too."""
