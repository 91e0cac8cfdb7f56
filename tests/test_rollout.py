# SPDX-License-Identifier: MIT
"""Phased rollouts (appliance/rollout.py): places uniform over a fleet, pause, stop, barriers, the
signed channel index, and maintenance windows across midnight."""

from __future__ import annotations

import calendar
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from appliance import paths, rollout
from appliance.errors import Refused
from appliance.signed import release_manifest
from builder import keys

DAY = 86400
START = "2026-12-01T00:00:00Z"
T0 = calendar.timegm((2026, 12, 1, 0, 0, 0))  # a Tuesday


def _ids(n: int) -> list[str]:
    return [uuid.UUID(int=i * 7919 + 1).hex for i in range(n)]  # machine ids as /etc/machine-id holds them


def _release(version: str, *, barrier: bool = False, **ro: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": version, "path": f"{version}/", "barrier": barrier}
    if ro:
        doc["rollout"] = {"start": START, "duration_s": 10 * DAY, **ro}
    return doc


def _channel(*releases: dict[str, Any], sequence: int = 1, signer: str = "0" * 16, signed_at: str = START,
             expires_at: str = "2026-12-31T00:00:00Z") -> dict[str, Any]:
    return {"format": 2, "channel": "stable", "sequence": sequence, "signed_at": signed_at, "expires_at": expires_at,
            "releases": list(releases), "signer": signer}


def test_places_are_uniform_within_two_percent_per_tenth_over_ten_thousand_machines() -> None:
    ids = _ids(10_000)
    for version in ("1.2.0", "1.3.0"):
        tenths = [0] * 10
        for machine in ids:
            tenths[int(rollout.place(machine, version) * 10)] += 1
        assert all(abs(count / len(ids) - 0.1) <= 0.02 for count in tenths), (version, tenths)


def test_a_machine_s_place_differs_between_releases() -> None:
    """The same appliances are not always the first ones: places of two releases are unrelated."""
    ids = _ids(2000)
    first = {m for m in ids if rollout.place(m, "1.2.0") < 0.1}
    again = {m for m in ids if rollout.place(m, "1.3.0") < 0.1}
    assert 0.05 < len(first & again) / len(first) < 0.2  # about a tenth of the first tenth, as chance gives


def test_the_share_grows_from_start_to_end_and_admits_about_that_part_of_the_fleet() -> None:
    channel = rollout.load(_channel(_release("1.1.0", state="active")))
    ids = _ids(10_000)
    for days, share in ((-1, 0.0), (0, 0.0), (2.5, 0.25), (5, 0.5), (10, 1.0), (20, 1.0)):
        now = T0 + days * DAY
        assert channel.releases[0].rollout is not None and channel.releases[0].rollout.share(now) == pytest.approx(share)
        admitted = sum(rollout.decide(channel, "1.0.0", m, now).target is not None for m in ids)
        assert abs(admitted / len(ids) - share) <= 0.02, (days, admitted)


def test_pause_freezes_the_share_and_stop_admits_nobody() -> None:
    ids = _ids(4000)
    paused = rollout.load(_channel(_release("1.1.0", state="paused", paused_at="2026-12-03T00:00:00Z"), sequence=2,
                                   signed_at="2026-12-03T00:00:00Z"))
    later = T0 + 9 * DAY
    admitted = [m for m in ids if rollout.decide(paused, "1.0.0", m, later).target is not None]
    assert abs(len(admitted) / len(ids) - 0.2) <= 0.02  # as on day 2, not day 9
    waiting = next(m for m in ids if m not in admitted)
    d = rollout.decide(paused, "1.0.0", waiting, later)
    assert d.waiting_for is not None and d.waiting_for.admits_at is None
    assert "waits until a newly signed index resumes it" in d.describe()
    assert rollout.when(d, (), later) is None
    stopped = rollout.load(_channel(_release("1.1.0", state="stopped"), sequence=3))
    assert not any(rollout.decide(stopped, "1.0.0", m, later).target for m in ids)


def test_an_appliance_outside_the_share_learns_when_it_will_be_admitted() -> None:
    channel = rollout.load(_channel(_release("1.1.0", state="active")))
    machine = next(m for m in _ids(1000) if 0.6 < rollout.place(m, "1.1.0") < 0.7)
    d = rollout.decide(channel, "1.0.0", machine, T0 + DAY)
    assert d.target is None and d.waiting_for is not None
    at = d.waiting_for.admits_at
    assert at is not None and T0 + 6 * DAY < at < T0 + 7 * DAY
    assert rollout.decide(channel, "1.0.0", machine, at + 1).target is not None
    assert rollout.decide(channel, "1.0.0", machine, at - 60).target is None


def test_a_barrier_is_never_skipped() -> None:
    channel = rollout.load(_channel(_release("1.1.0"), _release("1.2.0", barrier=True), _release("1.3.0"), _release("1.4.0")))
    machine = _ids(1)[0]
    assert rollout.decide(channel, "1.0.0", machine, T0).target.version == "1.2.0"  # type: ignore[union-attr]
    assert rollout.decide(channel, "1.2.0", machine, T0).target.version == "1.4.0"  # type: ignore[union-attr]
    assert rollout.decide(channel, "1.4.0", machine, T0).target is None


def test_a_barrier_whose_rollout_has_not_reached_this_appliance_holds_it_before_the_barrier() -> None:
    channel = rollout.load(_channel(_release("1.1.0"), _release("1.2.0", barrier=True, state="active"), _release("1.3.0")))
    late = next(m for m in _ids(1000) if rollout.place(m, "1.2.0") > 0.9)
    d = rollout.decide(channel, "1.0.0", late, T0 + DAY)
    assert d.target is not None and d.target.version == "1.1.0"  # what lies before the barrier
    assert [s.version for s in d.standings] == ["1.1.0", "1.2.0"]  # 1.3.0 is not even looked at
    assert rollout.decide(channel, "1.1.0", late, T0 + DAY).target is None


def test_a_hostile_or_malformed_index_is_refused_in_one_line() -> None:
    for bad, says in (
        (_channel(_release("1.1.0"), _release("1.1.0")), "listed twice"),
        (_channel(_release("1.1.0", state="paused")), "paused_at goes with state paused"),
        (_channel(_release("1.1.0", state="active", paused_at=START)), "paused_at goes with state paused"),
        (_channel(_release("1.1.0", state="rolling")), "active or paused or stopped"),
        (_channel({"version": "1.1.0", "path": "../etc/"}), "expected a directory beside the index"),
        (_channel({"version": "1.1.0", "path": "/abs/"}), "expected a directory beside the index"),
        (_channel(_release("1.1.0", state="active", duration_s=-1)), "seconds"),
        (_channel(), "0 releases"),
        ({**_channel(_release("1.1.0")), "extra": 1}, "unknown field 'extra'"),
    ):
        with pytest.raises(Refused, match=says) as e:
            rollout.load(bad)
        assert "\n" not in e.value.message


def test_the_index_is_trusted_only_by_its_signature_and_never_goes_back(tmp_path: Path) -> None:
    private, _ = keys.generate(tmp_path / "k")
    key = release_manifest.load_private_key(private)
    kid = release_manifest.key_id(key.public_key())
    trusted = {kid: key.public_key()}
    doc = _channel(_release("1.1.0", state="active"), sequence=5, signer=kid)
    data = rollout.dumps(doc)
    sig = release_manifest.encode_signature(key.sign(data))
    assert rollout.verify(data, sig, trusted).sequence == 5
    with pytest.raises(Refused, match="does not match any key this version trusts"):
        rollout.verify(data.replace(b'"active"', b'"paused"'), sig, trusted)
    stranger, _ = keys.generate(tmp_path / "s")
    other = release_manifest.load_private_key(stranger)
    with pytest.raises(Refused, match="does not match any key"):
        rollout.verify(data, release_manifest.encode_signature(other.sign(data)), trusted)
    channel = rollout.verify(data, sig, trusted)
    rollout.check_sequence(channel, 5)
    with pytest.raises(Refused, match="lower than the 6 this appliance accepted before"):
        rollout.check_sequence(channel, 6)


# ----------------------------------------------------------------------------------- maintenance windows


def _at(day: int, hour: int, minute: int = 0) -> int:
    return calendar.timegm((2026, 12, day, hour, minute, 0))


def test_a_window_across_midnight_covers_both_days() -> None:
    nightly = (rollout.Window(start="22:00", duration_min=240),)  # 22:00 to 02:00
    assert rollout.in_window(nightly, _at(1, 23, 30))
    assert rollout.in_window(nightly, _at(2, 1, 59))
    assert not rollout.in_window(nightly, _at(2, 2, 0))
    assert not rollout.in_window(nightly, _at(2, 21, 59))
    assert rollout.next_opening(nightly, _at(2, 12)) == _at(2, 22)
    assert rollout.next_opening(nightly, _at(2, 1)) == _at(2, 1)  # inside: now


def test_a_window_on_given_days_counts_its_start_day_even_after_midnight() -> None:
    saturday_night = (rollout.Window(start="23:00", duration_min=180, days=("sat",)),)  # Sat 23:00 to Sun 02:00
    saturday, sunday = _at(5, 23, 30), _at(6, 1, 30)  # 2026-12-05 is a Saturday
    assert rollout.in_window(saturday_night, saturday) and rollout.in_window(saturday_night, sunday)
    assert not rollout.in_window(saturday_night, _at(6, 23, 30))  # Sunday night is not Saturday's window
    assert rollout.next_opening(saturday_night, _at(7, 12)) == _at(12, 23)  # from Monday: next Saturday


def test_no_window_configured_means_any_time_and_the_install_waits_for_admission_and_a_window() -> None:
    assert rollout.in_window((), _at(3, 12))
    channel = rollout.load(_channel(_release("1.1.0", state="active")))
    machine = next(m for m in _ids(1000) if 0.3 < rollout.place(m, "1.1.0") < 0.35)
    d = rollout.decide(channel, "1.0.0", machine, T0)
    admitted = d.waiting_for.admits_at if d.waiting_for else None
    assert admitted is not None
    assert rollout.when(d, (), T0) == admitted
    nightly = (rollout.Window(start="02:00", duration_min=60),)
    opens = rollout.when(d, nightly, T0)
    assert opens is not None and opens >= admitted and rollout.in_window(nightly, opens)
    assert opens - admitted < DAY


# ----------------------------------------------------------------------------------- builder and updater


def _server(tmp_path: Path, key: Path, versions: tuple[str, ...]) -> Path:
    """An update server's channel directory with a real bundle per version (fake builds)."""
    from fake_release import bundle

    out = tmp_path / "server"
    out.mkdir()
    for version in versions:
        bundle(tmp_path, key, version).rename(out / version)
    return out


def _channel_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stable.toml"
    path.write_text(text)
    return path


ROLLING = """channel = "stable"
[[releases]]
version = "2.0.0"
path = "2.0.0/"
[releases.rollout]
start = "2026-12-01T00:00:00Z"
duration_s = 864000
state = "{state}"
{paused}"""


def test_the_builder_signs_the_channel_one_sequence_higher_each_time(tmp_path: Path) -> None:
    from fake_release import make_signing

    from builder import sign_channel

    key, trusted = make_signing(tmp_path)
    server = _server(tmp_path, key, ("2.0.0",))
    first = sign_channel.make(_channel_file(tmp_path, ROLLING.format(state="active", paused="")), server, key, now=T0)
    paused = ROLLING.format(state="paused", paused="paused_at = \"2026-12-02T00:00:00Z\"\n")
    second = sign_channel.make(_channel_file(tmp_path, paused), server, key, now=T0 + DAY)
    assert (first.sequence, second.sequence) == (1, 2)
    keys_ = release_manifest.trusted_keys(trusted)
    signed = rollout.verify((server / "channel.json").read_bytes(), (server / "channel.json.sig").read_bytes(), keys_)
    assert signed.releases[0].rollout is not None and signed.releases[0].rollout.state == "paused"


def test_the_builder_refuses_a_release_whose_bundle_is_not_beside_the_index(tmp_path: Path) -> None:
    from fake_release import make_signing

    from appliance.errors import UserError
    from builder import sign_channel

    key, _ = make_signing(tmp_path)
    server = _server(tmp_path, key, ("2.0.0",))
    text = ROLLING.format(state="active", paused="").replace('"2.0.0/"', '"3.0.0/"').replace('version = "2.0.0"', 'version = "3.0.0"')
    with pytest.raises(UserError, match=r"release 3\.0\.0: no bundle at") as e:
        sign_channel.make(_channel_file(tmp_path, text), server, key, now=T0)
    assert "\n" not in e.value.message and not (server / "channel.json").exists()
    with pytest.raises(UserError, match=r"holds version 2\.0\.0"):
        sign_channel.make(_channel_file(tmp_path, text.replace('"3.0.0/"', '"2.0.0/"')), server, key, now=T0)
    with pytest.raises(UserError, match="expected active or paused or stopped"):
        sign_channel.make(_channel_file(tmp_path, ROLLING.format(state="later", paused="")), server, key, now=T0)


def test_an_appliance_outside_the_share_does_not_update_and_a_newly_signed_index_lets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The updater's side: the channel's index decides, the bundle beside it is what is installed,
    and an index older than one acted on is refused (it could undo a pause or a stop)."""
    from fake_release import make_signing

    from appliance.fetch import Deadline
    from applianctl.update import channel
    from builder import sign_channel

    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    key, trusted = make_signing(tmp_path)
    server = _server(tmp_path, key, ("2.0.0",))
    machine = next(m for m in _ids(1000) if 0.5 < rollout.place(m, "2.0.0") < 0.6)

    def resolve(now: float) -> channel.Resolution:
        return channel.resolve(str(server / "channel.json"), ca=None, deadline=Deadline(60), keys_dir=trusted,
                               running_version="1.0.0", machine=machine, now=now, windows=())

    sign_channel.make(_channel_file(tmp_path, ROLLING.format(state="active", paused="")), server, key, now=T0)
    early = resolve(T0 + DAY)
    assert early.bundle is None and "installs: at 2026-12-0" in early.describe(T0 + DAY)
    # the operator pauses it on day 2: this appliance (place 0.5-0.6) is not reached on day 8 either
    paused = ROLLING.format(state="paused", paused="paused_at = \"2026-12-03T00:00:00Z\"\n")
    sign_channel.make(_channel_file(tmp_path, paused), server, key, now=T0 + 2 * DAY)
    stays = resolve(T0 + 8 * DAY)
    assert stays.bundle is None and "waits until a newly signed index resumes it" in stays.describe(T0 + 8 * DAY)
    # resumed with a start that reaches it at once: installs the bundle beside the index
    resumed = ROLLING.format(state="active", paused="").replace("864000", "60")
    sign_channel.make(_channel_file(tmp_path, resumed), server, key, now=T0 + 8 * DAY)
    now = resolve(T0 + 8 * DAY)
    assert now.bundle == str(server) + "/2.0.0/" and now.installs_at is not None and now.installs_at <= T0 + 8 * DAY
    assert channel.accepted_sequence("stable") == 3
    # the first index, served again, is refused
    replayed = {**release_manifest.parse_canonical((server / "channel.json").read_bytes()), "sequence": 1}
    (server / "channel.json").write_bytes(rollout.dumps(replayed))
    key_ = release_manifest.load_private_key(key)
    (server / "channel.json.sig").write_bytes(release_manifest.encode_signature(key_.sign((server / "channel.json").read_bytes())))
    with pytest.raises(Refused, match="lower than the 3 this appliance accepted before"):
        resolve(T0 + 9 * DAY)


# ----------------------------------------------------------------------------------- replays, staleness, the record


class _Server:
    """A channel directory whose index this test signs by hand (no bundles: resolving reads only the index)."""

    def __init__(self, tmp_path: Path) -> None:
        from fake_release import make_signing

        self.key, self.trusted = make_signing(tmp_path)
        self.private = release_manifest.load_private_key(self.key)
        self.kid = release_manifest.key_id(self.private.public_key())
        self.dir = tmp_path / "server"
        self.dir.mkdir()

    def sign(self, doc: dict[str, Any], *, raw: bool = False) -> None:
        data = release_manifest.canonical(doc) if raw else rollout.dumps(doc)
        (self.dir / rollout.CHANNEL).write_bytes(data)
        (self.dir / rollout.CHANNEL_SIG).write_bytes(release_manifest.encode_signature(self.private.sign(data)))

    def index(self, *releases: dict[str, Any], sequence: int, signed: int = T0, days: int = 7) -> dict[str, Any]:
        return _channel(*releases, sequence=sequence, signer=self.kid, signed_at=rollout.utc(signed),
                        expires_at=rollout.utc(signed + days * DAY))

    def resolve(self, now: float, running: str = "1.0.0", machine: str = "0" * 32) -> Any:
        from appliance.fetch import Deadline
        from applianctl.update import channel

        return channel.resolve(str(self.dir / rollout.CHANNEL), ca=None, deadline=Deadline(60), keys_dir=self.trusted,
                               running_version=running, machine=machine, now=now, windows=())


@pytest.fixture(name="server")
def server_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Server:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    return _Server(tmp_path)


OPEN = _release("2.0.0")  # no rollout: open to every appliance


@pytest.mark.parametrize("supersedes", [
    _release("2.0.0", state="paused", paused_at=START),
    _release("2.0.0", state="stopped"),
    _release("1.0.0"),  # nothing newer than the running 1.0.0
])
def test_an_index_that_installs_nothing_is_recorded_and_the_older_one_it_supersedes_refused(
        server: _Server, supersedes: dict[str, Any]) -> None:
    """Recorded only on install, a pause (or stop) of sequence 5 would let sequence 4, which still
    rolls the release out, install it when served again."""
    from applianctl.update import channel

    rolling = server.index(OPEN, sequence=4)
    server.sign(server.index(supersedes, sequence=5))
    assert server.resolve(T0 + DAY).bundle is None
    assert channel.accepted_sequence("stable") == 5
    server.sign(rolling)  # the older index, replayed
    with pytest.raises(Refused, match="sequence 4, lower than the 5 this appliance accepted before"):
        server.resolve(T0 + DAY)


def test_the_check_and_the_record_of_a_sequence_wait_for_whoever_holds_the_record(server: _Server) -> None:
    """`update --check` beside the timer's update: each reads the record, checks, writes; without
    the lock both read the old record and the one that writes last wins, a lower sequence too."""
    import threading

    from appliance.atomic import record_lock
    from applianctl.update import channel

    server.sign(server.index(OPEN, sequence=3))
    outcome: list[Any] = []
    with record_lock(paths.channel_path()):  # another update holds it
        other = threading.Thread(target=lambda: outcome.append(server.resolve(T0 + DAY)))
        other.start()
        other.join(timeout=1.0)
        assert other.is_alive() and not outcome, "resolved while another writer held the record"
        assert not paths.channel_path().exists()
    other.join(timeout=30)
    assert outcome and channel.accepted_sequence("stable") == 3
    assert not paths.channel_path().with_name("channel.json.lock").is_symlink()


def test_check_records_the_index_it_accepted(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """`update --check` takes the verified path too: what it saw supersedes every older index."""
    import argparse
    import types

    from applianctl.update import channel, command

    monkeypatch.setattr(paths, "TRUSTED_KEYS_DIR", server.trusted)
    monkeypatch.setattr(command.release, "running_manifest", lambda: types.SimpleNamespace(version="1.0.0"))
    monkeypatch.setattr(channel, "machine_id", lambda: "0" * 32)
    monkeypatch.setattr(channel, "maintenance_windows", lambda: ())
    monkeypatch.setattr(channel, "system_clock", lambda: float(T0 + DAY))
    server.sign(server.index(_release("2.0.0", state="stopped"), sequence=7))
    args = argparse.Namespace(check=True, ca=None, deadline=None, from_config=False)
    assert command._resolve_channel(str(server.dir / rollout.CHANNEL), args) is None
    assert channel.accepted_sequence("stable") == 7


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("damage", "says"), [
    (b"{not json", "not JSON"),
    (b'"stable"', "is not an object"),
    (b"true", "is not an object"),
    (b"-1", "is not an object"),
    (b"[3]", "is not an object"),
    (b'{"stable": -1}', "is not a sequence"),
    (b'{"stable": true}', "is not a sequence"),
    (b'{"stable": "9"}', "is not a sequence"),
    (b'{"other": [1]}', "is not a sequence"),
    ("directory", "is a directory"),
    ("fifo", "is a FIFO"),
    ("link", "is a symbolic link"),
    ("dev-zero", "is a symbolic link"),
])
def test_a_damaged_channel_record_refuses_every_index(server: _Server, damage: bytes | str, says: str) -> None:
    """Taken as no record, a damaged one would let any older index in: fail closed, and say how to repair."""
    from appliance.errors import UserError
    from applianctl.update import channel

    record = paths.channel_path()
    record.parent.mkdir(parents=True)
    if damage == "directory":
        record.mkdir()
    elif damage == "fifo":
        os.mkfifo(record)
    elif damage == "link":
        good = record.with_name("elsewhere.json")
        good.write_text('{"stable": 1}')
        record.symlink_to(good)
    elif damage == "dev-zero":
        record.symlink_to("/dev/zero")
    else:
        assert isinstance(damage, bytes)
        record.write_bytes(damage)
    server.sign(server.index(OPEN, sequence=2))
    with pytest.raises(UserError, match=says) as e:
        server.resolve(T0 + DAY)
    assert str(record) in e.value.message and "every channel index is refused" in e.value.message
    assert "\n" not in e.value.message and f"remove {record}" in e.value.hint
    assert type(e.value) is UserError, "the appliance's own state, not the index: exit 2"
    with pytest.raises(UserError):
        channel.accept(rollout.load(server.index(OPEN, sequence=3)))  # nor is it written over
    if damage in ("directory", "fifo", "link", "dev-zero"):
        return
    assert record.read_bytes() == damage
    record.unlink()  # the repair the hint names: the next index is trusted and recorded
    assert server.resolve(T0 + DAY).bundle is not None and channel.accepted_sequence("stable") == 2


def test_an_index_past_its_expiry_is_refused_as_stale(server: _Server) -> None:
    """A year-old signed index that hides the releases since is a freeze, not "nothing newer"."""
    server.sign(server.index(_release("1.0.0"), sequence=1, days=7))
    assert "next: nothing (this is the newest release" in server.resolve(T0 + 7 * DAY - 1).describe(T0)
    with pytest.raises(Refused, match=r"channel\.json expired at 2026-12-08T00:00:00Z; the clock says 2026-12-08T00:00:00Z") as e:
        server.resolve(T0 + 7 * DAY)
    assert "python3 -m builder channel" in e.value.hint
    with pytest.raises(Refused, match="expired at"):
        server.resolve(T0 + 366 * DAY)


def test_an_index_without_an_expiry_or_valid_too_long_is_refused() -> None:
    old = {k: v for k, v in _channel(OPEN).items() if k != "expires_at"}
    with pytest.raises(Refused, match=r"format = 1: expected 2") as e:
        rollout.load({**old, "format": 1})
    assert "python3 -m builder channel" in e.value.hint
    with pytest.raises(Refused, match="missing field 'expires_at'"):
        rollout.load(old)
    for expires, says in (("2027-12-03T00:00:00Z", "valid for 367 days"), (START, "valid for 0 days"),
                          ("2026-11-30T00:00:00Z", "valid for -1 days")):
        with pytest.raises(Refused, match=f"{says} from {START}: expected more than 0 and at most 366"):
            rollout.load(_channel(OPEN, expires_at=expires))
    rollout.load(_channel(OPEN, expires_at="2027-12-02T00:00:00Z"))  # 366 days, the longest


def test_an_index_signed_later_than_the_clock_allows_is_refused(server: _Server) -> None:
    """Signed "in 2099", its validity would count from then: refused beyond the clock skew allowed."""
    from appliance.signed import timestamp

    server.sign(server.index(OPEN, sequence=1, signed=T0 + timestamp.MAX_CLOCK_SKEW_S))
    assert server.resolve(T0).bundle is not None  # a signing host a little ahead: within the skew
    server.sign(server.index(OPEN, sequence=2, signed=T0 + timestamp.MAX_CLOCK_SKEW_S + 1))
    with pytest.raises(Refused, match=r"channel\.json was signed at 2026-12-01T00:05:01Z, later than the clock says "
                                      r"\(2026-12-01T00:00:00Z\) by more than 5 minutes") as e:
        server.resolve(T0)
    assert "timedatectl" in e.value.hint and "\n" not in e.value.message
    far = calendar.timegm((2099, 1, 1, 0, 0, 0))
    server.sign(server.index(OPEN, sequence=3, signed=far))
    with pytest.raises(Refused, match="signed at 2099-01-01T00:00:00Z"):
        server.resolve(T0)


def test_a_pause_is_signed_when_it_takes_effect_and_never_admits_more_than_now() -> None:
    """A pause "at" a time to come would admit more and more of the fleet until then."""
    later = "2026-12-09T00:00:00Z"
    with pytest.raises(Refused, match=f"paused_at {later} is later than the index's signed_at {START}") as e:
        rollout.load(_channel(_release("1.1.0", state="paused", paused_at=later)))
    assert "set paused_at to the time of signing or earlier" in e.value.hint
    rollout.load(_channel(_release("1.1.0", state="paused", paused_at=START)))  # paused as it is signed
    # an appliance whose clock lags the signing host (within the skew): paused at its own now
    paused = rollout.Rollout(start=START, duration_s=10 * DAY, state="paused", paused_at=later)
    assert paused.share(T0 + DAY) == pytest.approx(0.1)
    assert paused.share(T0 + 20 * DAY) == pytest.approx(0.8)


def test_the_index_must_name_the_key_that_signed_it(server: _Server) -> None:
    """Signed by a trusted key but naming another: the index is inconsistent, refused."""
    doc = {**server.index(OPEN, sequence=1), "signer": "0123456789abcdef"}
    server.sign(doc)
    with pytest.raises(Refused, match=f"names signer 0123456789abcdef but was signed by {server.kid}"):
        server.resolve(T0)


# ----------------------------------------------------------------------------------- the machine id


def test_the_machine_id_is_read_as_a_file_someone_else_could_have_written(tmp_path: Path) -> None:
    import threading

    from appliance.errors import UserError
    from applianctl.update import channel

    good = tmp_path / "machine-id"
    good.write_text("0123456789abcdef0123456789abcdef\n")
    assert channel.machine_id(good) == "0123456789abcdef0123456789abcdef"
    link = tmp_path / "link"
    link.symlink_to(good)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big"
    big.write_text("0" * 100_000)
    latin = tmp_path / "latin"
    latin.write_bytes(b"0123456789abcdef0123456789abcd\xe9\xe9\n")
    for path, says in ((link, "is a symbolic link"), (zero, "is a symbolic link"), (big, "100000 bytes, more than 64"),
                       (latin, "is not UTF-8 text"), (tmp_path / "none", "no such file")):
        with pytest.raises(UserError, match=says) as e:
            channel.machine_id(path)
        assert "\n" not in e.value.message and "systemd-machine-id-setup" in e.value.hint
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException | str] = []

    def read() -> None:
        try:
            outcome.append(channel.machine_id(fifo))
        except BaseException as e:  # handed to the test's thread
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "a FIFO with no writer: read without blocking, and refused"
    assert isinstance(outcome[0], UserError) and "is a FIFO" in outcome[0].message


# ----------------------------------------------------------------------------------- the builder's expiry and count


def test_the_builder_signs_an_expiry_and_counts_on_from_any_index_there(tmp_path: Path) -> None:
    from fake_release import make_signing

    from appliance.errors import UserError
    from builder import sign_channel

    key, _ = make_signing(tmp_path)
    server = _server(tmp_path, key, ("2.0.0",))
    source = _channel_file(tmp_path, ROLLING.format(state="active", paused=""))
    first = sign_channel.make(source, server, key, now=T0)
    assert (first.signed_at, first.expires_at) == (START, "2026-12-08T00:00:00Z")  # 7 days by default
    assert sign_channel.make(source, server, key, now=T0, days=30).expires_at == "2026-12-31T00:00:00Z"
    for days in (0, 367, -1):
        with pytest.raises(UserError, match=f"--days {days}: expected a number of days from 1 to 366"):
            sign_channel.make(source, server, key, now=T0, days=days)
    # an index of the format before expiries: the count goes on from it, not from 1
    index = server / rollout.CHANNEL
    older = {k: v for k, v in release_manifest.parse_canonical(index.read_bytes()).items() if k != "expires_at"}
    index.write_bytes(release_manifest.canonical({**older, "format": 1, "sequence": 41}))
    assert sign_channel.make(source, server, key, now=T0).sequence == 42
    # one whose sequence cannot be read is refused: counted from 1 again, appliances would refuse it
    for damaged in (b"{not json", release_manifest.canonical({**older, "sequence": "41"})):
        index.write_bytes(damaged)
        with pytest.raises(UserError, match=r"channel\.json") as e:
            sign_channel.make(source, server, key, now=T0)
        assert "put the last index signed back" in e.value.hint and index.read_bytes() == damaged
