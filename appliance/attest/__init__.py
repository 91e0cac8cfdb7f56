# SPDX-License-Identifier: MIT
"""Remote attestation's verifier core: the evidence documents (`evidence`), TPM 2.0 wire structures
(`tpm_wire`), the firmware's TCG event log (`event_log`) and the check of one quote (`verify`)."""
