# SPDX-License-Identifier: MIT
"""The installer: runs from RAM on the installer medium, never on the appliance, and writes the release
onto the one disk the signed install plan names.
"""
