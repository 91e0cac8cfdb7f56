# SPDX-License-Identifier: MIT
"""/var on the device: its encryption and seal to the machine (seal)."""
