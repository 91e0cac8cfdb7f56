# SPDX-License-Identifier: MIT
"""The Caddyfile at build time: re-exports appliance/caddyfile.py, which the device's
appliance-host.service uses too (same checks and template for the plan's per-host settings).
"""

from __future__ import annotations

from appliance.caddyfile import ADMIN_SOCKET, CADDYFILE_PATH, CANONICAL_RE, LOOPBACK, TEMPLATE, allowed_re, render_caddyfile

__all__ = ["ADMIN_SOCKET", "CADDYFILE_PATH", "CANONICAL_RE", "LOOPBACK", "TEMPLATE", "allowed_re", "render_caddyfile"]
