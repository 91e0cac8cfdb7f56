# SPDX-License-Identifier: MIT
"""Status part `weights`: the model snapshot the signed weights manifest pins, and whether the last
check before an engine start (applianctl model verify) found every file exactly as signed.

Status reads that check's result file rather than measuring again: it stays within its deadline
and reports what the engine was started on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from appliance.config import Config
from appliance.errors import UserError
from appliance.schema import load_record
from applianctl.records import ModelVerifyResult, WeightsFetch
from applianctl.status.document import WeightsDetails
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part


def probe_weights(config: Config, manifest: Path | None = None, release: Path | None = None,
                  result: Path | None = None, host_dir: Path | None = None) -> Part:
    # here, not at the top: the manifest code imports cryptography, which this probe's thread
    # then loads beside the others instead of before every probe starts
    from applianctl.model import store
    try:
        model = store.load_manifest(manifest, release)
    except UserError as e:
        return Part(DOWN, e.message, WeightsDetails(revision=config.model.revision, files=None, bytes=None, verified=False,
                                                    source=None, file=None))
    if model is None:
        return Part(NOT_CONFIGURED, "this image pins no weights (no weights manifest)",
                    WeightsDetails(revision=config.model.revision, files=None, bytes=None, verified=None, source=None, file=None))
    try:
        fetched = load_record(WeightsFetch, (host_dir or store.host_dir()) / store.FETCH_STATE, lenient=True)
    except UserError:
        fetched = None  # only the source shown is at stake: the configured one stands in
    source = fetched.source if fetched is not None else None
    details = WeightsDetails(revision=model.revision, files=len(model.files), bytes=model.total_bytes, verified=None,
                             source=source or config.model.source or None, file=None)
    try:
        checked = load_record(ModelVerifyResult, result or store.verify_result(), lenient=True)
    except UserError:
        return Part(DEGRADED, f"{result or store.verify_result()}: unreadable", details)
    if checked is None:
        return Part(DEGRADED, "not checked yet (applianctl model verify runs before the engine starts)", details)
    if checked.revision != model.revision:
        return Part(DEGRADED, "the last check was of another revision", details)
    if not checked.ok:
        refused = dataclasses.replace(details, verified=False, file=checked.file)
        return Part(DOWN, checked.reason.removeprefix("model weights: "), refused)
    return Part(OK, "", dataclasses.replace(details, verified=True))
