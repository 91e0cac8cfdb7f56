# SPDX-License-Identifier: MIT
"""Test machinery, never in a production image. Demo images (which the tests boot) carry the guest
half, installed by builder/render.py for the demo profile only: the boot check (bootcheck.py) and
the units in units/ (its own, and the synthetic faults'). The rest runs on the test host: the
synthetic bad versions (faults.py) and the stand-in engine as a process (standin.py)."""
