# SPDX-License-Identifier: MIT
"""`applianctl selftest`: every GPU checked read-only before an engine starts, within 20 s.

`readings.py` gathers the raw outputs (amd-smi, else rocm-smi, the kernel's files and log) under one
deadline; `facts.py` reads them into per-GPU facts, tolerating any shape; `checks.py` judges the
facts against `Expectations` (one frozen dataclass, MI300X defaults) and says per GPU ok, failed
with one-line reasons, or not checked with the reason; `command.py` is the command line.
"""
