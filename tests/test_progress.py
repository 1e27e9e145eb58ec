"""Start-up steps said as they begin (spind/progress.py), and `spind start --detach` echoing the ones its daemon
writes to the log while it waits, so that a detached first start is not silent."""

from __future__ import annotations

from spind.frontend.daemon_cli import echo_progress
from spind.progress import about, say


def test_a_step_says_its_expected_time(capsys) -> None:
    assert about(6.4) == "~6 s" and about(0.2) == "~1 s" and about(None) == ""
    say("converting x (once; ~7 s)")
    assert capsys.readouterr().err == "spind: converting x (once; ~7 s)\n"


def test_a_detached_start_echoes_the_daemons_steps_whole_lines_only(tmp_path, capsys) -> None:
    log = tmp_path / "spind.log"
    log.write_text("2026-11-26 INFO worker target ready\nspind: converting x (once; ~7 s)\nspind: load")
    offset = echo_progress(log, 0)
    assert capsys.readouterr().err == "spind: converting x (once; ~7 s)\n"
    assert offset == len("2026-11-26 INFO worker target ready\nspind: converting x (once; ~7 s)\n")
    with open(log, "a") as f:
        f.write("ing default, ~5 s ...\n")
    assert echo_progress(log, offset) == log.stat().st_size
    assert capsys.readouterr().err == "spind: loading default, ~5 s ...\n"
    assert echo_progress(tmp_path / "missing.log", 7) == 7
