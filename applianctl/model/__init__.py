# SPDX-License-Identifier: MIT
"""The weights: fetch, store, seal and the check before every engine start (`applianctl model`)."""
