# SPDX-License-Identifier: MIT
"""Remote attestation, the device's side: the TPM's identity (EK and AK), quotes over a verifier's
nonce with the firmware's event log, and credential activation (appliance-attest.service,
`applianctl attest`)."""
