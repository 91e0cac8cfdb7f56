# SPDX-License-Identifier: MIT
"""The A/B /usr slots, the engine slots and the boot entries: one read model, and assess and rollback."""
