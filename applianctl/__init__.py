# SPDX-License-Identifier: MIT
"""The appliance's on-device command line and services (installed into the image's /usr)."""

__version__ = "0.1.0"
