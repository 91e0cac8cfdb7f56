# SPDX-License-Identifier: MIT
"""The serving judge (appliance-judge.service): each replica judged by its progress, and hive-wide GPU faults."""
