# SPDX-License-Identifier: MIT
"""`applianctl status`: one probe per part, all under one deadline."""
