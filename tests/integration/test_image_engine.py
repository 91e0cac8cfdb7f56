# SPDX-License-Identifier: MIT
"""The engine, supervised by systemd through the production quadlet, in the booted demo image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance import config

pytestmark = pytest.mark.integration


def test_engine_reaches_healthy_through_the_production_unit(first_boot: dict[str, Any]) -> None:
    assert first_boot["engine_became_healthy"]
    engine = first_boot["status"]["parts"]["engine"]
    assert engine["state"] == "ok", engine
    assert engine["models"] == ["standin/tiny-demo"] or "standin/tiny-demo" in str(engine)
    # the demo's two replicas, each a template instance on its own port, both serving
    replicas = [(r["replica"], r["url"], r["state"]) for r in engine["replicas"]]
    assert replicas == [(0, "http://127.0.0.1:8000", "ok"), (1, "http://127.0.0.1:8002", "ok")], engine["replicas"]
    units = first_boot["status"]["parts"]["units"]["units"]
    assert [units[f"appliance-engine@{i}.service"]["active_state"] for i in (0, 1)] == ["active", "active"]


def test_the_second_replica_started_once_the_first_was_healthy(first_boot: dict[str, Any], demo_config: config.Config) -> None:
    """Staggered starts: replica 1's container started only once replica 0 was healthy (or, on a
    host so loaded that replica 0 took longer, stagger_s after replica 1's unit was started)."""
    first, second = (first_boot["replica_starts"][f"appliance-engine@{i}.service"] for i in (0, 1))
    assert second["stagger"] and "appliance-engine@0.service" in second["stagger"][0], second
    bound = min(first["active"], second["started"] + demo_config.topology.stagger_s * 1_000_000)
    assert 0 < bound <= second["main_started"], (first, second)
    assert not first["stagger"]  # replica 0 never waits


# What podman itself puts in a container's environment, besides the image's own variables, and
# what the quadlet sets for every engine (units/appliance-engine@.container.j2: weights are never
# fetched at run time).
PODMAN_ENV = {"PATH", "HOME", "HOSTNAME", "TERM", "container"}
UNIT_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "APPLIANCE_REPLICA": "0"}  # replica 0's container


def test_engine_environment_in_the_running_container_equals_the_configuration(
    first_boot: dict[str, Any], demo_config: config.Config
) -> None:
    # Read from the engine process's /proc/PID/environ: every configured value exactly (the
    # demo has one with "%" and one with spaces), no variable split or added on the way.
    env = first_boot["engine_env"]
    assert "error" not in env, env
    pairs = [v.partition("=") for v in env["environ"]]
    names = [name for name, _, _ in pairs]
    assert len(names) == len(set(names)), env["environ"]
    seen = {name: value for name, _, value in pairs}
    expected = dict(demo_config.engine.environment)  # engine.env and PYTHONHASHSEED=0
    assert {"HSA_COREDUMP_PATTERN", "STANDIN_SPACED"} <= set(expected)  # the hard cases are configured
    assert {name: seen.get(name) for name in expected} == expected, env["environ"]
    image_names = {v.partition("=")[0] for v in env["image_env"]}
    assert {name: seen[name] for name in set(UNIT_ENV) & set(names)} == {n: UNIT_ENV[n] for n in set(UNIT_ENV) & set(names)}
    assert set(names) - set(expected) <= PODMAN_ENV | image_names | set(UNIT_ENV), env["environ"]
    assert seen.get("APPLIANCE_REPLICA") == "0", env["environ"]  # the template's %i, expanded by systemd


def test_smoke_prompt_answers_391_on_the_engine_port(first_boot: dict[str, Any]) -> None:
    assert first_boot["smoke_engine"]["answer"].strip() == "391", first_boot["smoke_engine"]


def test_demo_overlay_is_mounted_and_in_effect(first_boot: dict[str, Any]) -> None:
    # standin/answers.py says "upstream"; the signed overlay mounted over it says "overlay-demo".
    assert first_boot["smoke_engine"]["answers_variant"] == "overlay-demo"


def test_startup_report_matches_expected_figures(first_boot: dict[str, Any]) -> None:
    startup = first_boot["status"]["parts"]["startup"]
    assert startup["state"] == "ok", startup


def test_verified_manifest_and_signer_in_status(first_boot: dict[str, Any]) -> None:
    verify = first_boot["status"]["parts"]["verify"]
    assert verify["state"] == "ok", verify
    assert verify["version"] == "1.0.0" and len(verify["signer"]) == 16


def test_slow_start_inside_the_start_period_is_not_killed(faults_boot: dict[str, Any]) -> None:
    slow = faults_boot["scenarios"]["slow_start"]
    assert slow["active"] and slow["automatic_restarts"] == 0, slow
    assert slow["seconds_to_healthy"] >= 60  # the engine loaded for 60 s and was left alone


def test_crash_is_restarted_and_its_stale_offload_file_removed(faults_boot: dict[str, Any]) -> None:
    crash = faults_boot["scenarios"]["crash"]
    assert crash["restarted"], crash
    (stale,) = crash["offload_files_before"]
    assert stale not in crash["offload_files_after"]
    assert len(crash["offload_files_after"]) == 1  # the new engine's own
    assert f"removed {stale}" in crash["cleaner_log"] or Path(stale).name in crash["cleaner_log"]
    # the other replica's live file: kept by the cleaner that ran before replica 0's restart
    (live,) = crash["other_files_before"]
    assert crash["other_files_after"] == [live] and f"kept {live}" in crash["cleaner_log"], crash


def test_a_replica_killed_under_load_fails_only_its_requests_in_flight(faults_boot: dict[str, Any]) -> None:
    """Four clients streaming completions through the proxy while replica 0's engine is SIGKILLed:
    only requests sent before the kill (in flight on it) may fail, at most one per client (each
    client has one request in flight, under the replica's concurrency); none sent afterwards, while
    replica 0 was down and once it was back."""
    crash = faults_boot["scenarios"]["crash"]
    assert "error" not in crash["killed"], crash["killed"]
    stream = crash["stream"]
    assert stream["failed_after_kill"] == [], stream
    assert len(stream["failed_before_kill"]) <= stream["clients"], stream
    assert stream["sent_after_kill"] >= 20 and stream["ok_after_kill"] == stream["sent_after_kill"], stream


def test_a_failing_replica_restarts_alone(faults_boot: dict[str, Any]) -> None:
    """Replica 0 was restarted, crashed and hung; replica 1 served on, never restarted."""
    scenarios = faults_boot["scenarios"]
    before, after = scenarios["others_before"], scenarios["others_after"]
    assert list(before) == ["appliance-engine@1.service"] and before == after, (before, after)
    assert after["appliance-engine@1.service"]["active"] == "active"


def test_hang_is_detected_and_restarted(faults_boot: dict[str, Any]) -> None:
    hang = faults_boot["scenarios"]["hang"]
    assert hang["restarted"], hang["engine_log"]


def test_a_deadlocked_replica_is_judged_stalled_taken_out_and_restarted(faults_boot: dict[str, Any]) -> None:
    """Replica 1's engine core deadlocked under four streaming clients (/health and /metrics stayed
    200, nothing answered): the judge found no tokens with requests waiting within its bound, the
    replica left the rotation, was restarted, warmed and judged alive again; replica 0 was never
    restarted for it."""
    deadlock = faults_boot["scenarios"]["deadlock"]
    assert deadlock["judged"] and deadlock["gone"] and deadlock["restarted"] and deadlock["alive_again"], deadlock
    # the bound: stall_after_s from the last token, one round late at most, and the slack of a loaded guest
    assert deadlock["seconds_to_judged"] <= deadlock["stall_after_s"] + 2 * deadlock["interval_s"] + 30, deadlock
    assert "stalled" in deadlock["judge_log"] and "replica 1" in deadlock["judge_log"], deadlock["judge_log"]
    # not before: the judge decides two rounds early (applianctl/judge/progress.py), never earlier
    assert deadlock["seconds_to_judged"] >= deadlock["stall_after_s"] - 2 * deadlock["interval_s"] - 1, deadlock


def test_the_deadlock_fails_only_the_requests_in_flight_on_the_replica(faults_boot: dict[str, Any]) -> None:
    """Requests sent while replica 1 was deadlocked and not yet taken out may fail (each client has
    at most one there, held until the kill); none sent once it was out, and traffic went on."""
    stream = faults_boot["scenarios"]["deadlock"]["stream"]
    assert stream["failed_after_kill"] == [], stream
    assert len(stream["failed_until_removed"]) + len(stream["failed_before_kill"]) <= stream["clients"], stream
    assert stream["sent_after_kill"] >= 10 and stream["ok_after_kill"] == stream["sent_after_kill"], stream


def test_status_and_the_metrics_say_why_the_replica_was_restarted(faults_boot: dict[str, Any]) -> None:
    deadlock = faults_boot["scenarios"]["deadlock"]
    replicas = {r["replica"]: r for r in deadlock["engine_part"]["replicas"]}
    judged = replicas[1]["judgement"]
    assert judged["state"] in ("stalled", "restarting"), replicas[1]
    assert replicas[1]["state"] == "down" and replicas[0]["judgement"]["state"] == "alive", replicas
    assert "no tokens for" in judged["reason"] or judged["state"] == "restarting", judged
    lines = [line for line in deadlock["replica_state_lines"] if 'replica="1"' in line and line.endswith(" 1")]
    assert any('state="stalled"' in line or 'state="restarting"' in line for line in lines), deadlock["replica_state_lines"]


def test_tampered_overlay_keeps_the_engine_stopped_and_is_named(tampered_boot: dict[str, Any]) -> None:
    assert not tampered_boot["engine_became_healthy"]
    verify = tampered_boot["status"]["parts"]["verify"]
    assert verify["state"] == "down", verify
    # erofs keeps a small file's data inline, in the same 4 KiB block as other inodes (here the
    # manifest's): dm-verity refuses that whole block, so the file named is the overlay itself or
    # the first file verify reads from the refused block.
    reason = verify["reason"]
    assert "standin_answers.py" in reason or (reason.startswith("/usr/lib/appliance/") and "Input/output error" in reason), verify
    engine_unit = tampered_boot["status"]["parts"]["units"]["units"]["appliance-engine@0.service"]
    assert engine_unit["active_state"] != "active", engine_unit
