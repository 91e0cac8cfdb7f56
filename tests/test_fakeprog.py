# SPDX-License-Identifier: MIT
"""The fake programs of tests/fakeprog.py record each call's whole argument vector."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fakeprog import calls, fake_program, record, sh_record


def test_argument_boundaries_newlines_and_empty_arguments_are_kept(tmp_path: Path) -> None:
    prog = fake_program(tmp_path / "bin", "tool")
    subprocess.run([str(prog), "a b"], check=True, env={})
    subprocess.run([str(prog), "a", "b"], check=True, env={})
    subprocess.run([str(prog), "line 1\nline 2", "", "--x=\\0 'q' \"d\" $HOME *"], check=True, env={})
    subprocess.run([str(prog)], check=True, env={})
    assert calls(tmp_path / "bin" / "calls.log") == [
        ["tool", "a b"],
        ["tool", "a", "b"],
        ["tool", "line 1\nline 2", "", "--x=\\0 'q' \"d\" $HOME *"],
        ["tool"],
    ]


def test_stdout_body_exit_status_and_one_log_for_several_programs(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    sfdisk = fake_program(tmp_path / "bin", "sfdisk", stdout='{"a": "b c"}\n', log=log)
    failing = fake_program(tmp_path / "bin", "failing", script_body="echo oops >&2", exit=3, log=log)
    out = subprocess.run([str(sfdisk), "-J", "/dev/vda"], capture_output=True, text=True, check=True)
    assert out.stdout == '{"a": "b c"}\n'
    bad = subprocess.run([str(failing), "x"], capture_output=True, text=True)
    assert (bad.returncode, bad.stderr) == (3, "oops\n")
    record(log, ["python-fake", "é", "x y"])
    assert calls(log) == [["sfdisk", "-J", "/dev/vda"], ["failing", "x"], ["python-fake", "é", "x y"]]
    assert calls(log, "failing") == [["failing", "x"]]
    assert calls(tmp_path / "absent.log") == []


def test_a_script_body_may_record_words_of_its_own(tmp_path: Path) -> None:
    log = tmp_path / "seen.log"
    (tmp_path / "d").mkdir()
    for name in ("f 1", "f2"):
        (tmp_path / "d" / name).write_text("")
    prog = fake_program(tmp_path / "bin", "lister", script_body=f'cd "$1" && ({sh_record(log, "listing", "*")})')
    subprocess.run([str(prog), str(tmp_path / "d")], check=True)
    assert calls(log) == [["listing", "f 1", "f2"]]
    assert calls(tmp_path / "bin" / "calls.log") == [["lister", str(tmp_path / "d")]]
