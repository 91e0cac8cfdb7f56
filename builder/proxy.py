"""The Caddyfile at build time: appliance/caddyfile.py, which the device shares (appliance-host.service
renders the install plan's per-host settings through the same checks and template)."""

from __future__ import annotations

from appliance.caddyfile import ADMIN_SOCKET, CADDYFILE_PATH, CANONICAL_RE, LOOPBACK, TEMPLATE, allowed_re, render_caddyfile

__all__ = ["ADMIN_SOCKET", "CADDYFILE_PATH", "CANONICAL_RE", "LOOPBACK", "TEMPLATE", "allowed_re", "render_caddyfile"]
