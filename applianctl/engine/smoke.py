# SPDX-License-Identifier: MIT
"""`applianctl smoke`: the runbook's smoke test, through the proxy as a client sees it.

GET /v1/models, then POST /v1/completions with the runbook's prompt at temperature 0; the answer
must contain 391. By default it goes to https://127.0.0.1:{proxy.https_port}, sends the configured
hostname as SNI and Host, and trusts the appliance CA (paths.TLS_DIR/ca.crt) or, when there is
none (ACME certificates), the system's CAs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from appliance import cli_help, paths
from appliance.config.model import SMOKE_PROMPT
from appliance.errors import UserError
from appliance.host_settings import load_device

PROMPT = SMOKE_PROMPT
EXPECTED = "391"


class _Sni(HTTPAdapter):  # type: ignore[misc]  # requests has no stubs here
    """Connect to one address, but speak TLS (SNI, certificate name) for HOSTNAME."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["server_hostname"] = self.hostname
        kwargs["assert_hostname"] = self.hostname
        super().init_poolmanager(*args, **kwargs)


@dataclass
class Result:
    ok: bool
    message: str
    models_s: float | None = None
    completion_s: float | None = None
    answer: str | None = None
    unreachable: bool = False  # nothing answered at the address (no connection, or no answer in time)


def _os_reason(e: BaseException) -> str:
    """The socket's own words under a requests/urllib3 error ("Connection refused"), or ""."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop(0)
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and isinstance(x.strerror, str) and x.strerror:
            return x.strerror
        if isinstance(x, TimeoutError) or type(x).__name__.endswith("TimeoutError"):
            return "timed out"
        todo += [*x.args, getattr(x, "reason", None), x.__cause__, x.__context__]
    return ""


def _unreachable(url: str, what: str, e: BaseException, timeout: float) -> Result:
    if isinstance(e, requests.exceptions.ReadTimeout):
        return Result(False, f"{what} at {url}: no answer within {timeout:g} s", unreachable=True)
    reason = _os_reason(e)
    return Result(False, f"could not reach {url} ({what}): {reason or type(e).__name__}", unreachable=True)


def session_for(url: str, hostname: str | None, verify: bool | str) -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    s.verify = verify
    if hostname and url.startswith("https://"):
        s.mount(url.rstrip("/") + "/", _Sni(hostname))
    if hostname:
        s.headers["Host"] = hostname
    return s


def smoke(session: requests.Session, url: str, model: str, timeout: float = 60.0) -> Result:
    url = url.rstrip("/")
    what = "GET /v1/models"
    try:
        t0 = time.monotonic()
        r = session.get(f"{url}/v1/models", timeout=timeout)
        models_s = time.monotonic() - t0
        if r.status_code != 200:
            return Result(False, f"GET /v1/models answered HTTP {r.status_code}", models_s)
        served = [str(m.get("id")) for m in r.json().get("data", [])]
        if model not in served:
            return Result(
                False, f"GET /v1/models does not list {model} (it lists {', '.join(served) or 'nothing'})", models_s
            )
        body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 32}
        what = "POST /v1/completions"
        t0 = time.monotonic()
        r = session.post(f"{url}/v1/completions", json=body, timeout=timeout)
        completion_s = time.monotonic() - t0
        if r.status_code != 200:
            return Result(False, f"POST /v1/completions answered HTTP {r.status_code}", models_s, completion_s)
        answer = str(r.json()["choices"][0]["text"])
    except requests.exceptions.SSLError as e:
        return Result(False, f"TLS failed: {e}".splitlines()[0][:300])
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
        return _unreachable(url, what, e, timeout)
    except requests.RequestException as e:
        return Result(False, f"{url}: {type(e).__name__}: {e}".splitlines()[0][:300])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return Result(False, f"the answer is not an OpenAI completion ({type(e).__name__}: {e})")
    if EXPECTED not in answer:
        return Result(
            False, f"the completion {answer.strip()!r} does not contain {EXPECTED}", models_s, completion_s, answer
        )
    return Result(True, "smoke test passed", models_s, completion_s, answer)


def run(args: argparse.Namespace) -> int:
    config = load_device()
    model = args.model or config.served_model
    if args.url:
        url, hostname = args.url, None
        verify: bool | str = str(args.ca) if args.ca else True
    else:
        url = f"https://127.0.0.1:{config.proxy.https_port}"
        hostname = config.proxy.hostname
        ca = Path(args.ca) if args.ca else paths.TLS_DIR / "ca.crt"
        verify = str(ca) if ca.exists() else True
        if args.ca and not ca.exists():
            raise UserError(f"{ca}: no such file", hint="pass the CA certificate the proxy's certificate is signed by")
    if args.insecure:
        verify = False
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    result = smoke(session_for(url, hostname, verify), url, model, args.timeout)
    if getattr(args, "json", False):
        print(json.dumps({"url": url, "model": model, **dataclasses.asdict(result)}, indent=2))
    else:
        if result.models_s is not None:
            print(f"GET  {url}/v1/models: {result.models_s * 1000:.0f} ms")
        if result.completion_s is not None:
            print(f"POST {url}/v1/completions: {result.completion_s:.2f} s, answer {(result.answer or '').strip()!r}")
        print(("ok: " if result.ok else "FAILED: ") + result.message)
    if result.unreachable:
        sys.stdout.flush()
        if args.url:
            hint = f"is anything serving at {url}? `applianctl status` shows the engine and the proxy"
        else:
            hint = "is the proxy running? `applianctl status`, `applianctl logs proxy`"
        print(f"hint: {hint}", file=sys.stderr)
    return 0 if result.ok else 1


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "smoke", "run the runbook's smoke completion through the proxy",
        examples=["applianctl smoke", "applianctl smoke --url http://127.0.0.1:8000 --json"],
        exit_codes=[(0, "the completion came back with the expected answer"),
                    (1, "it did not: unreachable, an HTTP error, or a wrong answer (the reason on the last line)"),
                    cli_help.BAD_INPUT],
    )
    p.add_argument("--url", help="base URL to test instead of the local proxy (e.g. http://127.0.0.1:8000)")
    p.add_argument("--ca", help="CA certificate to trust (default: the appliance CA, else the system's)")
    p.add_argument("--insecure", action="store_true", help="do not verify the TLS certificate")
    p.add_argument("--model", help="model name to ask for (default: the configured served model)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each answer (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
