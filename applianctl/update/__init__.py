# SPDX-License-Identifier: MIT
"""`applianctl update`: plan, download, stage and install a signed release bundle."""
