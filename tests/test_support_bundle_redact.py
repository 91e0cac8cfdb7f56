# SPDX-License-Identifier: MIT
"""Redaction by family: a value named by anything ending in PASSWORD, SECRET, TOKEN, KEY...,
credentials in URLs, secret options' values, cookies and authorization headers, private keys whole
or cut; and ordinary text left as it is."""

from __future__ import annotations

import json

import pytest

from applianctl.support_bundle.redact import REDACTED, redact, redact_member

R = REDACTED


@pytest.mark.parametrize(("text", "expected"), [
    ("DB_PASSWORD=correct horse battery", f"DB_PASSWORD={R}"),
    ("export AWS_SECRET_ACCESS_KEY='wJalr XUtn' # set", f"export AWS_SECRET_ACCESS_KEY='{R}' # set"),
    ("GITHUB_TOKEN: zz9-plain", f"GITHUB_TOKEN: {R}"),
    ("db.password = two words", f"db.password = {R}"),
    ('{"db_password": "a \\" b", "host": "db1", "ApiKey": "k k"}', f'{{"db_password": "{R}", "host": "db1", "ApiKey": "{R}"}}'),
    ('log {\\"api_key\\": \\"v v\\", \\"n\\": 1}', f'log {{\\"api_key\\": \\"{R}\\", \\"n\\": 1}}'),
    ('{"pin_secret": 1234, "var_recovery_key": true}', f'{{"pin_secret": {R}, "var_recovery_key": true}}'),
])
def test_names_ending_in_a_secret_word(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("https://alice:Sup3r@host/x", f"https://alice:{R}@host/x"),
    ("postgres://u:p@ss@db:5432/app ok", f"postgres://u:{R}@db:5432/app ok"),
    ("git clone https://ghtoken0@github.com/a/b", f"git clone https://{R}@github.com/a/b"),
])
def test_credentials_in_urls(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("serve --password hunter2 --port 8000", f"serve --password {R} --port 8000"),
    ("serve --password=hunter2 --api-key k3y --token 'two words' x", f"serve --password={R} --api-key {R} --token '{R}' x"),
    ("run --client-secret=s3 --secret-file /etc/x --key --next", f"run --client-secret={R} --secret-file /etc/x --key --next"),
    ("['vllm', '--api-key', 'k 3', '--port']", f"['vllm', '--api-key', '{R}', '--port']"),
])
def test_secret_options(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("> Cookie: session=abc; theme=dark", f"> Cookie: {R}"),
    ("< Set-Cookie: sid=abc; Path=/; HttpOnly", f"< Set-Cookie: {R}"),
    ("Authorization: Basic dXNlcjpwYXNz", f"Authorization: Basic {R}"),
    ("Proxy-Authorization: Negotiate YIIabc", f"Proxy-Authorization: Negotiate {R}"),
    ("curl -H 'authorization: Token abc' -H 'Cookie: a=b c' https://x", f"curl -H 'authorization: Token {R}' -H 'Cookie: {R}' https://x"),
    ('{"log": "Authorization: Basic ab\\"cd ef", "n": 1}', f'{{"log": "Authorization: Basic {R}", "n": 1}}'),
])
def test_cookies_and_authorization_headers(text: str, expected: str) -> None:
    assert redact(text) == expected


KEY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw"


@pytest.mark.parametrize(("text", "expected"), [
    (f"a\n-----BEGIN RSA PRIVATE KEY-----\n{KEY}\n-----END RSA PRIVATE KEY-----\nb", f"a\n{R}\nb"),
    (f"a\n-----BEGIN OPENSSH PRIVATE KEY-----\n{KEY}\n", f"a\n{R}"),  # cut by a head limit
    (f"{KEY}\n-----END ENCRYPTED PRIVATE KEY-----\nb", f"{R}\nb"),  # cut by a tail limit
    (f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n{KEY}\n-----END PGP PRIVATE KEY BLOCK-----", R),
])
def test_private_keys_whole_or_cut(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_known_token_formats_anywhere() -> None:
    text = ("hf_abcdefghijklmnopqrstuvwxyz12 sk-proj-abcdefghijklmnop12 ghp_abcdefghijklmnopqrstuv1234 AKIAABCDEFGHIJKLMNOP "
            "Bearer eyJhbGciOi.payload cbdefghi-jklnrtuv-cbdefghi-jklnrtuv-cbdefghi-jklnrtuv-cbdefghi-jklnrtuv")
    assert redact(text) == " ".join([R] * 4 + [f"Bearer {R}", R])


def test_ordinary_text_survives() -> None:
    text = ("engine ready; version 1.0.0; digest sha256:" + "ab" * 32 + "; token bucket refilled; recovery key shown once\n"
            "max_tokens=100 TOKEN_COUNT=5 password_file=/run/credentials/x key-file: /etc/k.pem\n"
            "proxy https://mirror.example:8443/weights --port 8000 --max-num-seqs 256\n")
    assert redact(text) == text


def test_redaction_is_idempotent() -> None:
    text = 'DB_PASSWORD=x y\n{"token": "t"} Authorization: Bearer abcdefgh12 --password p https://u:p@h'
    assert redact(redact(text)) == redact(text)


def test_a_json_member_stays_json_and_hides_by_its_keys() -> None:
    doc = {"state": "ok", "details": {"var_recovery_key": True, "db_password": 1234, "credentials": {"user": "u", "pw": "nested"}},
           "argv": ["vllm", "--api-key", "k3y", "--port", "8000"], "line": "DB_PASSWORD=x y",
           "headers": "Authorization: Basic abc\nHost: h"}
    out = json.loads(redact_member("status.json", json.dumps(doc).encode()))
    assert out == {"state": "ok", "details": {"var_recovery_key": True, "db_password": R, "credentials": R},
                   "argv": ["vllm", "--api-key", R, "--port", "8000"], "line": f"DB_PASSWORD={R}",
                   "headers": f"Authorization: Basic {R}\nHost: h"}


def test_a_key_split_across_json_strings_is_still_hidden() -> None:
    doc = {"lines": ["-----BEGIN PRIVATE KEY-----", KEY, "-----END PRIVATE KEY-----", "after"]}
    out = redact_member("x.json", json.dumps(doc).encode()).decode()
    assert KEY not in out and "after" in out


def test_a_member_that_is_not_json_is_redacted_as_text() -> None:
    assert redact_member("cut.json", b'{"a": 1,\nDB_PASSWORD=x') == f'{{"a": 1,\nDB_PASSWORD={R}'.encode()
