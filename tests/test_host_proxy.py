# SPDX-License-Identifier: MIT
"""The proxy takes the signed install plan's per-host settings: appliance-host's apply renders the
Caddyfile with the plan's name, allowlist and ACME e-mail (checked by the real Caddy), refuses
hostile values before any file is written and fails its unit for them, and every reader of the
configuration (appliance.config load_device: certificate names, assessment, console, status) sees
the plan's values; without a plan everything is the image's. `builder plan` checks each value as
the device renders it: a plan that signs is a plan that renders."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

import appliance.config
from appliance import caddyfile, host_settings, paths
from appliance.errors import ConfigError, UserError
from appliance.signed import install_plan
from applianctl import host, tls
from applianctl.records import HostResult
from applianctl.slots import assess
from builder import keys

REPO = Path(__file__).resolve().parents[1]
CADDY = shutil.which("caddy") or "/usr/bin/caddy"
needs_caddy = pytest.mark.skipif(not os.access(CADDY, os.X_OK), reason="needs Debian's caddy (apt install caddy)")

PLAN_NAME = "gpu-07.example.net"
PLAN_CIDRS = ("10.20.0.0/16", "2001:db8:20::/48")
PLAN_EMAIL = "noc@gpu-07.example.net"


@dataclasses.dataclass
class Host:
    """A host's directories: the plan's (/var/lib/appliance/host), the runtime one, networkd's."""

    root: Path
    private_key: Path
    trusted: Path

    @property
    def host_dir(self) -> Path:
        return self.root / "host"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def result(self) -> Path:
        return self.run_dir / "host.json"

    def install(self, plan: install_plan.Plan) -> None:
        data, sig = install_plan.sign(plan, self.private_key)
        self.host_dir.mkdir(parents=True, exist_ok=True)
        (self.host_dir / install_plan.PLAN_JSON).write_bytes(data)
        (self.host_dir / install_plan.PLAN_SIG).write_bytes(sig)

    def apply(self, config: appliance.config.Config) -> HostResult:
        return host.apply(config, self.host_dir, self.root / "network", self.result, self.trusted, set_hostname=False)

    def proxy_files(self) -> list[str]:
        return sorted(n for n in (host.CADDYFILE, host.PROXY_ENV, host.HOST_SETTINGS) if (self.run_dir / n).exists())



@pytest.fixture(autouse=True)
def no_host_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The privileged step names the host: in a test, never the machine running the tests."""
    def refuse(name: str) -> None:
        raise AssertionError(f"a test called sethostname({name!r}) on the host running the tests")

    monkeypatch.setattr(host.socket, "sethostname", refuse)


@pytest.fixture
def machine(tmp_path: Path) -> Host:
    private, public = keys.generate(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(public, trusted / "release.pub")
    return Host(tmp_path / "machine", private, trusted)


def _image(tls_mode: str = "internal") -> appliance.config.Config:
    """The demo image's configuration (mode internal), or the same with ACME."""
    config = appliance.config.load(REPO / "appliance.toml", "demo")
    if tls_mode == "acme":
        config = dataclasses.replace(config, proxy=dataclasses.replace(config.proxy, tls="acme", acme_email="ops@example.net"))
    return config


def _plan(**proxy: Any) -> install_plan.Plan:
    # Built directly (not from TOML): the hostile cases must reach the signature and the device's checks.
    return install_plan.Plan(hostname="gpu-07", proxy=host_settings.Proxy(**proxy))


def _caddy(args: list[str], path: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config")}
    return subprocess.run([CADDY, *args, "--adapter", "caddyfile", "--config", str(path)],
                          capture_output=True, text=True, env=env, timeout=60)


def _remote_ips(adapted: dict[str, Any]) -> list[list[str]]:
    """Every remote_ip matcher's ranges in Caddy's own JSON of the Caddyfile."""
    found: list[list[str]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("remote_ip"), dict):
                found.append(node["remote_ip"]["ranges"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(adapted)
    return found


# ------------------------------------------------------------------------------ the Caddyfile


@pytest.mark.programs
@needs_caddy
def test_apply_renders_the_plans_caddyfile_and_caddy_accepts_it(machine: Host, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    certs = tmp_path / "tls"
    tls.generate(certs, PLAN_NAME, tls.host_addresses(), group="appliance-no-such-group")
    monkeypatch.setattr(paths, "TLS_DIR", certs)  # `caddy validate` loads the certificate files
    image = _image()
    machine.install(_plan(hostname=PLAN_NAME, allowed_cidrs=PLAN_CIDRS))
    doc = machine.apply(image)
    assert doc.ok is True and doc.source == "plan", doc
    assert doc.settings.proxy_hostname == PLAN_NAME
    assert machine.proxy_files() == sorted([host.CADDYFILE, host.PROXY_ENV, host.HOST_SETTINGS])
    path = machine.run_dir / host.CADDYFILE
    assert (machine.run_dir / host.PROXY_ENV).read_text() == f"CADDYFILE={path}\n"
    assert path.stat().st_mode & 0o044 == 0o044, "the proxy runs as caddy: the file must be readable"

    text = path.read_text()
    assert f"default_sni {PLAN_NAME}" in text and image.proxy.hostname not in text
    expected = dataclasses.replace(image, proxy=dataclasses.replace(image.proxy, hostname=PLAN_NAME, allowed_cidrs=PLAN_CIDRS))
    assert text == caddyfile.render_caddyfile(expected)  # the builder's rendering, with the plan's values

    out = _caddy(["validate"], path, tmp_path / "home")
    assert out.returncode == 0 and "Valid configuration" in out.stdout + out.stderr, out.stderr[-2000:]
    adapted = _caddy(["adapt"], path, tmp_path / "home")
    assert adapted.returncode == 0, adapted.stderr
    ranges = _remote_ips(json.loads(adapted.stdout))
    # The engine's route admits the plan's networks and the loopback, never the image's own list.
    assert [*PLAN_CIDRS, *caddyfile.LOOPBACK] in ranges
    # (the metrics site's scrapers are the image's own in this plan: not the engine's route)
    scrapers = [*image.metrics.allowed_cidrs, *caddyfile.LOOPBACK]
    assert scrapers in ranges
    engine_ranges = [r for r in ranges if r != scrapers]
    assert not any(cidr in r for r in engine_ranges for cidr in image.proxy.allowed_cidrs if cidr not in caddyfile.LOOPBACK)


@pytest.mark.programs
@needs_caddy
def test_the_plans_acme_email_and_name_reach_the_acme_issuer(machine: Host, tmp_path: Path) -> None:
    machine.install(_plan(hostname=PLAN_NAME, acme_email=PLAN_EMAIL))
    assert machine.apply(_image("acme")).ok is True
    adapted = _caddy(["adapt"], machine.run_dir / host.CADDYFILE, tmp_path / "home")
    assert adapted.returncode == 0, adapted.stderr
    data = json.loads(adapted.stdout)
    policies = data["apps"]["tls"]["automation"]["policies"]
    assert any(PLAN_NAME in p.get("subjects", []) for p in policies), policies
    issuers = [i for p in policies for i in p.get("issuers", [])]
    assert issuers and all(i.get("email") == PLAN_EMAIL for i in issuers if i["module"] == "acme"), issuers
    assert "ops@example.net" not in adapted.stdout


# ------------------------------------------------------------------------------ refused values


@pytest.mark.parametrize(
    ("proxy", "message"),
    [
        ({"allowed_cidrs": ("10.0.0.0/8 }",)}, "proxy.allowed_cidrs[0] = '10.0.0.0/8 }': invalid"),
        ({"allowed_cidrs": ("10.0.0.0/8\n}\nimport /etc/x",)}, "proxy.allowed_cidrs[0]"),
        ({"hostname": "gpu{07}.example.net"}, "proxy.hostname = 'gpu{07}.example.net': invalid"),
        ({"hostname": "gpu-07.example.net {\n\trespond 200\n}"}, "proxy.hostname"),
        ({"acme_email": "ops@example.net }"}, "proxy.acme_email"),
    ],
)
def test_a_hostile_signed_plan_is_refused_and_no_caddyfile_is_written(machine: Host, proxy: dict[str, Any],
                                                                        message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    named: list[str] = []
    monkeypatch.setattr(host.socket, "sethostname", named.append)
    # An earlier boot's rendering must not survive either: the proxy then takes the image's file.
    machine.run_dir.mkdir(parents=True)
    for name in (host.CADDYFILE, host.PROXY_ENV, host.HOST_SETTINGS):
        (machine.run_dir / name).write_text("stale")
    machine.install(_plan(**proxy))
    doc = machine.apply(_image("acme"))
    assert doc.ok is False and doc.source == "plan" and message in doc.reason, doc
    assert machine.proxy_files() == []
    assert json.loads(machine.result.read_text())["reason"] == doc.reason
    # signed: not a quiet fallback to the image's proxy; the unit's last step fails in one line
    with pytest.raises(UserError) as e:
        host.privileged(machine.result, runner=lambda argv: None)
    assert e.value.message == doc.reason and "\n" not in e.value.message and "builder plan" in (e.value.hint or "")


def test_a_signed_plan_whose_proxy_values_do_not_render_fails_the_unit_and_keeps_the_rest(
        machine: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    # Signed before `builder plan` checked as the device does: an empty allowlist admits no client.
    machine.install(_plan(hostname=PLAN_NAME, allowed_cidrs=()))
    image = _image()
    doc = machine.apply(image)
    assert doc.ok is False and doc.source == "plan"
    assert doc.reason.startswith("the signed install plan does not apply on this version: "), doc.reason
    assert "proxy.allowed_cidrs is empty" in doc.reason and "its network, host name and SSH keys apply" in doc.reason
    assert machine.proxy_files() == []
    # status shows what applies: the plan's host name, the image's proxy
    assert doc.settings.hostname == "gpu-07"
    assert doc.settings.proxy_hostname == image.proxy.hostname
    assert list(doc.settings.proxy_allowed_cidrs) == list(image.proxy.allowed_cidrs)
    # The privileged step still gives the host the plan's name (a refused proxy value is no reason
    # to leave the host misnamed); the test records it instead of renaming the machine it runs on.
    named: list[str] = []
    monkeypatch.setattr(host.socket, "sethostname", named.append)
    with pytest.raises(UserError, match=r"proxy\.allowed_cidrs is empty"):
        host.privileged(machine.result, runner=lambda argv: None)
    assert named == ["gpu-07"]
    # status shows it: part host degraded, with the reason
    import applianctl.status.host
    from applianctl.status import probes

    part = applianctl.status.host.probe_host(image, probes.Sources(run=lambda argv, timeout: (1, "")), machine.result)
    assert part.state == probes.DEGRADED and part.reason == doc.reason and part.to_json()["source"] == "plan"


def test_a_signed_plan_this_version_refuses_outright_applies_nothing_and_fails_the_unit(machine: Host) -> None:
    machine.install(install_plan.Plan(hostname="a" * 65))  # signed unchecked: no host may take this name
    doc = machine.apply(_image())
    assert doc.ok is False and doc.source == "plan" and doc.settings is None
    assert "hostname" in doc.reason and doc.reason.endswith("nothing of it applies"), doc.reason
    with pytest.raises(UserError, match="the signed install plan does not apply"):
        host.privileged(machine.result, runner=lambda argv: None)


def test_a_plan_not_signed_by_a_trusted_key_leaves_the_defaults_without_failing_the_unit(machine: Host, tmp_path: Path) -> None:
    other, _ = keys.generate(tmp_path / "other")
    data, sig = install_plan.sign(_plan(hostname=PLAN_NAME), other)
    machine.host_dir.mkdir(parents=True)
    (machine.host_dir / install_plan.PLAN_JSON).write_bytes(data)
    (machine.host_dir / install_plan.PLAN_SIG).write_bytes(sig)
    doc = machine.apply(_image())
    assert doc.ok is False and doc.source == "image defaults"
    assert host.privileged(machine.result, runner=lambda argv: None) == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"proxy": {"allowed_cidrs": ["10.0.0.0/8 }"]}}, "proxy.allowed_cidrs[0] = '10.0.0.0/8 }': invalid"),
        ({"proxy": {"hostname": "a{b}.example.net"}}, "proxy.hostname = 'a{b}.example.net': invalid"),
        ({"proxy": {"allowed_cidrs": []}}, "allowed_cidrs = (): refused for the Caddyfile"),
        ({"proxy": {"tls": "acme"}}, "not per-host settings"),
        ({"engine": {"port": 1}}, "not per-host settings"),
        (["proxy"], "not per-host settings"),
    ],
)
def test_the_device_checks_the_settings_file_again(appliance_json: Callable[[str], Path], tmp_path: Path,
                                                    settings: Any, message: str) -> None:
    path = tmp_path / "host-settings.json"
    path.write_text(json.dumps(settings))
    with pytest.raises(ConfigError) as e:
        host_settings.load_device(appliance_json("demo"), path)
    assert message in e.value.message and str(path) in e.value.message, e.value.message
    assert "\n" not in e.value.message and e.value.hint and e.value.exit_status == 2


# ------------------------------------------------------------------------------ the readers


@pytest.mark.programs
def test_readers_see_the_plans_values(machine: Host, appliance_json: Callable[[str], Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    image_json = appliance_json("demo")
    image = appliance.config.load_image(image_json)
    machine.install(_plan(hostname=PLAN_NAME, allowed_cidrs=PLAN_CIDRS))
    assert machine.apply(image).ok is True
    monkeypatch.setenv("APPLIANCE_CONFIG", str(image_json))
    monkeypatch.setenv("APPLIANCE_HOST_SETTINGS", str(machine.run_dir / host.HOST_SETTINGS))

    device = host_settings.load_device()
    assert (device.proxy.hostname, device.proxy.allowed_cidrs) == (PLAN_NAME, PLAN_CIDRS)
    assert dataclasses.replace(device, proxy=image.proxy) == image  # nothing else changed
    assert assess.client_target(device).server_name == PLAN_NAME

    # `applianctl tls generate` (appliance-tls.service) names the plan's host in the certificate
    tls_dir = tmp_path / "tls"
    monkeypatch.setattr(paths, "TLS_DIR", tls_dir)
    monkeypatch.setattr(tls, "PROXY_GROUP", "appliance-no-such-group")
    parser = argparse.ArgumentParser()
    tls.add_parser(parser.add_subparsers())
    args = parser.parse_args(["tls", "generate", "--no-reload"])
    assert args.func(args) == 0
    server = x509.load_pem_x509_certificate((tls_dir / "server.crt").read_bytes())
    assert tls.san_names(server)[0] == [PLAN_NAME]


def test_without_a_plan_everything_is_the_images(machine: Host, appliance_json: Callable[[str], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    image_json = appliance_json("demo")
    image = appliance.config.load_image(image_json)
    machine.run_dir.mkdir(parents=True)
    for name in (host.CADDYFILE, host.PROXY_ENV, host.HOST_SETTINGS):  # an earlier boot's plan, since removed
        (machine.run_dir / name).write_text("stale")
    doc = machine.apply(image)
    assert doc.ok is True and doc.source == "image defaults"
    assert machine.proxy_files() == []
    assert doc.settings.proxy_hostname == image.proxy.hostname
    monkeypatch.setenv("APPLIANCE_CONFIG", str(image_json))
    monkeypatch.setenv("APPLIANCE_HOST_SETTINGS", str(machine.run_dir / host.HOST_SETTINGS))
    assert host_settings.load_device() == image
    assert assess.client_target(host_settings.load_device()).server_name == image.proxy.hostname

    # A plan without proxy settings: the image's Caddyfile stays in use too.
    machine.install(install_plan.Plan(hostname="gpu-07"))
    assert machine.apply(image).ok is True
    assert machine.proxy_files() == []
    assert host_settings.load_device() == image


# ------------------------------------------------------------------------------ the image


def test_the_image_carries_the_template_and_the_device_renders_with_it(tmp_path: Path) -> None:
    """The build installs units/Caddyfile.j2 as /usr/lib/appliance/Caddyfile.j2, and the core
    package as installed (no units/ beside it) renders the image's own Caddyfile from it."""
    from builder import engine_store, render

    image = _image()
    store = engine_store.EngineStore(tmp_path / "e", tmp_path / "v", "ab" * 32, engine_store.label_for(image.engine.digest))
    tree = tmp_path / "tree"
    render.render_units(image, tree, store)
    render.install_applianctl(tree)
    lib = tree / "usr/lib/appliance"
    assert (lib / caddyfile.TEMPLATE).read_text() == (REPO / "units" / caddyfile.TEMPLATE).read_text()
    (tmp_path / "appliance.json").write_text(json.dumps(image.to_json()))
    script = (
        "import json, sys; from pathlib import Path\n"
        "from appliance import caddyfile, config\n"
        "assert caddyfile.__file__.startswith(sys.argv[1]), caddyfile.__file__\n"
        "print(caddyfile.template_dir())\n"
        "c = config.from_json(json.loads(Path('appliance.json').read_text()), Path('appliance.json'))\n"
        "sys.stdout.write(caddyfile.render_caddyfile(c))\n"
    )
    packages = tree / "usr/lib/python3/dist-packages"
    out = subprocess.run([sys.executable, "-c", script, str(packages)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(packages), "APPLIANCE_LIB_DIR": str(lib)})
    assert out.returncode == 0, out.stderr
    where, text = out.stdout.split("\n", 1)
    assert where == str(lib)
    assert text == (lib / "Caddyfile").read_text()


# ------------------------------------------------------------------ update, metrics and logs per host

COLLECTOR = "https://logs.example.net:19532"


def test_the_plans_update_url_windows_metrics_and_logs_reach_every_reader(machine: Host,
                                                                        appliance_json: Callable[[str], Path]) -> None:
    from plan_values import CA_PEM

    window = appliance.config.model.MaintenanceWindow(start="22:30", duration_min=120, days=("sat",))
    machine.install(install_plan.Plan(
        update=host_settings.Update(url="https://updates.example.net/stable/channel.json", maintenance_windows=(window,)),
        metrics=host_settings.Metrics(allowed_cidrs=("198.51.100.7/32",), client_ca=CA_PEM),
        logs=host_settings.Logs(upload_url=COLLECTOR, upload_ca=CA_PEM)))
    result = machine.apply(_image())
    assert result.ok, result.reason
    device = host_settings.load_device(appliance_json("demo"), machine.run_dir / host.HOST_SETTINGS)
    # the update timer (applianctl update --from-config) reads these: before, the plan's url never reached it
    assert device.update.url == "https://updates.example.net/stable/channel.json"
    assert device.update.maintenance_windows == (window,)
    assert device.metrics.allowed_cidrs == ("198.51.100.7/32",)
    assert (machine.run_dir / paths.METRICS_CLIENT_CA.name).read_text() == CA_PEM
    assert (machine.run_dir / paths.JOURNAL_UPLOAD_CA.name).read_text() == CA_PEM
    assert (machine.run_dir / paths.JOURNAL_UPLOAD_ENV.name).read_text() == f"UPLOAD_URL={COLLECTOR}\n"
    caddy_text = (machine.run_dir / host.CADDYFILE).read_text()
    assert "remote_ip 198.51.100.7/32 127.0.0.1/32 ::1/128" in caddy_text
    assert f"trusted_ca_cert_file {paths.METRICS_CLIENT_CA}" in caddy_text
    assert result.settings is not None and result.settings.logs_upload_url == COLLECTOR


def test_the_plans_weights_source_is_the_fetchs_default_source(machine: Host, appliance_json: Callable[[str], Path],
                                                              tmp_path: Path) -> None:
    from applianctl.model.store import HOST_SOURCE, Store

    mirror = "https://weights.example.net/dsv4/"
    machine.install(install_plan.Plan(weights=host_settings.Weights(source=mirror)))
    result = machine.apply(_image())
    assert result.ok, result.reason
    device = host_settings.load_device(appliance_json("demo"), machine.run_dir / host.HOST_SETTINGS)
    assert device.model.source == mirror and result.settings is not None and result.settings.weights_source == mirror
    # `applianctl model fetch` without a SOURCE: a per-host model-source file, else this
    (tmp_path / "host").mkdir()
    store = Store(manifest=None, snapshot=tmp_path, partial=tmp_path, host_dir=tmp_path / "host")  # type: ignore[arg-type]
    assert store.default_source(device) == mirror
    (store.host_dir / HOST_SOURCE).write_text("/srv/weights\n")
    assert store.default_source(device) == "/srv/weights"
    # without a plan the image's own
    assert host_settings.load_device(appliance_json("demo"), tmp_path / "none.json").model.source == _image().model.source


def test_without_a_collector_nothing_is_left_for_the_upload_unit(machine: Host) -> None:
    from plan_values import CA_PEM

    machine.install(install_plan.Plan(logs=host_settings.Logs(upload_url=COLLECTOR, upload_ca=CA_PEM)))
    assert machine.apply(_image()).ok
    assert (machine.run_dir / paths.JOURNAL_UPLOAD_ENV.name).exists()
    machine.install(install_plan.Plan(hostname="gpu-08"))  # a new plan without logs: the image's (none)
    assert machine.apply(_image()).ok
    assert not (machine.run_dir / paths.JOURNAL_UPLOAD_ENV.name).exists()
    assert not (machine.run_dir / paths.JOURNAL_UPLOAD_CA.name).exists()
    assert not (machine.run_dir / host.CADDYFILE).exists()  # nothing of the proxy's changed


def test_a_plan_with_an_upload_url_and_no_ca_is_refused_with_the_image_settings_kept(machine: Host) -> None:
    machine.install(install_plan.Plan(hostname="gpu-09", logs=host_settings.Logs(upload_url=COLLECTOR)))
    result = machine.apply(_image())
    assert not result.ok and "logs.upload_url needs logs.upload_ca" in result.reason
    assert not (machine.run_dir / paths.JOURNAL_UPLOAD_ENV.name).exists()
    assert result.settings is not None and result.settings.hostname == "gpu-09"  # the rest of the plan holds


@pytest.mark.parametrize("pem", ["-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                                 "not a certificate", "-----BEGIN CERTIFICATE-----\n}\n-----END CERTIFICATE-----\n"])
def test_a_ca_that_is_not_pem_certificates_is_refused_by_the_plan(pem: str) -> None:
    with pytest.raises(ConfigError) as e:
        install_plan.from_plain({"metrics": {"client_ca": pem}}, "plan.toml")
    assert "metrics.client_ca" in e.value.message and "PEM" in (e.value.hint or "")


@pytest.mark.parametrize(("section", "key", "value"), [
    ("logs", "upload_url", "http://logs.example.net:19532"),  # the journal only over TLS
    ("logs", "upload_url", "https://logs.example.net:19532/x y"),
    ("metrics", "allowed_cidrs", ["10.0.0.1/8"]),  # host bits set: not what the Caddyfile would say
    ("update", "maintenance_windows", [{"start": "24:00", "duration_min": 60}]),
])
def test_per_host_values_the_device_could_not_use_are_refused_by_the_plan(section: str, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        install_plan.from_plain({section: {key: value}}, "plan.toml")
    assert f"{section}." in e.value.message and e.value.hint


# ------------------------------------------------------------------------------ signs == renders

_LONGEST = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters: the longest DNS name


def _toml(doc: dict[str, Any]) -> str:
    """DOC as TOML: top-level values, then one table per section (JSON's strings and lists are TOML's)."""
    top = [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [f"[{k}]\n" + "".join(f"{n} = {json.dumps(x, ensure_ascii=False)}\n" for n, x in v.items())
              for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables)


@pytest.mark.parametrize(("doc", "renders"), [
    ({"proxy": {"allowed_cidrs": []}}, False),
    ({"proxy": {"allowed_cidrs": ["10.0.0.1/8"]}}, False),
    ({"proxy": {"allowed_cidrs": ["10.0.0.0/8 "]}}, False),
    ({"proxy": {"allowed_cidrs": ["10.0.0.0/8\n"]}}, False),
    ({"proxy": {"allowed_cidrs": ["١٠.0.0.0/8"]}}, False),
    ({"proxy": {"allowed_cidrs": ["fe80::/10%eth0"]}}, False),
    ({"proxy": {"allowed_cidrs": ["10.0.0.0/8", "2001:db8::/32"]}}, True),
    ({"proxy": {"acme_email": "ops@Example.NET"}}, False),
    ({"proxy": {"acme_email": "OPS@example.net"}}, True),
    ({"proxy": {"acme_email": " ops@example.net"}}, False),
    ({"proxy": {"acme_email": "ops@example.net\n"}}, False),
    ({"proxy": {"acme_email": "ops@exämple.net"}}, False),
    ({"proxy": {"acme_email": ""}}, False),
    ({"proxy": {"acme_email": "o" * 4000 + "@example.net"}}, True),
    ({"proxy": {"hostname": "GPU-07.example.net"}}, False),
    ({"proxy": {"hostname": "gpü-07.example.net"}}, False),
    ({"proxy": {"hostname": "gpu-07.example.net "}}, False),
    ({"proxy": {"hostname": _LONGEST}}, True),
    ({"proxy": {"hostname": _LONGEST + "a"}}, False),
    ({"hostname": "a" * 63 + ".b"}, False),  # 65 characters: sethostname() refuses it
    ({"hostname": "a" * 62 + ".b"}, True),
    ({"hostname": "Gpu-07"}, False),
    ({"metrics": {"allowed_cidrs": []}}, True),  # no scraper from the network: the default
    ({"metrics": {"allowed_cidrs": ["10.0.0.0/8 "]}}, False),
    ({"logs": {"upload_url": "https://logs.example.net:19532"}}, False),  # no CA, and the image has none
    ({"update": {"url": "https://updates.example.net/appliance/"}}, True),
    ({"update": {"url": "https://updates.example.net/a b"}}, False),
    ({"weights": {"source": "/srv/weights dir"}}, False),
    ({"weights": {"source": "/srv/weights"}}, True),
])
def test_builder_plan_signs_exactly_what_the_device_renders(machine: Host, tmp_path: Path, doc: dict[str, Any], renders: bool) -> None:
    from builder import sign_plan

    image = _image()
    doc = {"hostname": "gpu-07", **doc} if "hostname" not in doc else doc
    # the device: the same values signed without any check, as an older builder could have
    signer = install_plan.release_manifest.key_id(install_plan.release_manifest.load_private_key(machine.private_key).public_key())
    data = install_plan.release_manifest.canonical({**doc, "signer": signer})
    machine.host_dir.mkdir(parents=True)
    (machine.host_dir / install_plan.PLAN_JSON).write_bytes(data)
    (machine.host_dir / install_plan.PLAN_SIG).write_bytes(
        install_plan.release_manifest.encode_signature(install_plan.release_manifest.load_private_key(machine.private_key).sign(data)))
    applied = machine.apply(image)
    assert applied.source == "plan" and applied.ok is renders, applied.reason
    # `builder plan`: signs it only if the device renders it
    source = tmp_path / "plan.toml"
    source.write_text(_toml(doc))
    out = tmp_path / "signed"
    if renders:
        sign_plan.write(source, machine.private_key, out, image)
        assert (out / install_plan.PLAN_JSON).exists()
    else:
        with pytest.raises(ConfigError) as e:
            sign_plan.write(source, machine.private_key, out, image)
        assert "\n" not in e.value.message and e.value.hint and e.value.exit_status == 2
        assert not out.exists()
