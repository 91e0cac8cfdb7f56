# SPDX-License-Identifier: MIT
"""The core the builder (host) and applianctl (device) share: the configuration model, the
release formats, downloads, hashing, paths, the error type, atomic writes and one subprocess helper.
It ships in the image's /usr, so it imports only what the image's Python has: the standard
library, cryptography, and jinja2 (only where a Caddyfile is rendered).
"""
