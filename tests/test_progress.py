"""Progress bars on the long commands and ``vismemo --quiet`` (issue U item 4)."""

from __future__ import annotations

import logging

import pytest

from vismemo_hf import progress
from vismemo_hf.cli import main, parser


@pytest.fixture(autouse=True)
def restore_progress():
    """Every test leaves the process as it found it: bars from VISMEMO_QUIET, other libraries' bars back on, the
    progress loggers' levels unset."""
    yield
    progress.configure(quiet=False)  # undoes what a --quiet turned off
    progress.set_enabled(None)
    for name in progress.PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_the_helper_draws_on_stderr_unless_progress_is_off(capsys, monkeypatch):
    monkeypatch.delenv("VISMEMO_QUIET", raising=False)
    assert progress.enabled()
    assert list(progress.progress(range(3), desc="counting")) == [0, 1, 2]
    captured = capsys.readouterr()
    assert "counting" in captured.err and "/3" in captured.err and captured.out == ""
    progress.set_enabled(False)
    with progress.progress(total=3, desc="silent") as bar:  # takes every call, draws nothing
        bar.update(3)
        bar.set_postfix(loss="0.1")
        bar.set_postfix_str("phase")
    assert list(progress.progress(range(2), desc="silent")) == [0, 1]
    assert capsys.readouterr().err == ""
    progress.set_enabled(None)
    monkeypatch.setenv("VISMEMO_QUIET", "1")
    assert not progress.enabled()
    list(progress.progress(range(2), desc="silent"))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("VISMEMO_QUIET", "0")
    assert progress.enabled()
    list(progress.progress(range(2), desc="counting", disable=True))  # a bar of its own switch (report context)
    assert capsys.readouterr().err == ""


def test_a_step_and_time_bounded_loop_gets_the_total_it_will_reach():
    class Bar:
        total = 20000

    bar = Bar()
    progress.fit_total(bar, 0, 0.0, 600, 20000)
    assert bar.total == 20000  # no rate yet
    progress.fit_total(bar, 10, 60.0, 600, 20000)  # 10 steps a minute, 9 minutes left
    assert bar.total == 100
    progress.fit_total(bar, 10, 1.0, 600, 2000)  # 10 steps a second: the step count binds first
    assert bar.total == 2000
    progress.fit_total(bar, 10, 60.0, 600, 20000, offset=500)  # a resumed run's bar starts at step 500
    assert bar.total == 600


def test_bench_shows_a_bar_and_quiet_prints_none(tmp_path, capsys):
    args = ["bench", "trace", "--requests", "50", "--capacities", "5"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    assert "trace:" in captured.err and "/2 " in captured.err  # the replays, on stderr
    assert "| capacity |" in captured.out and "trace:" not in captured.out  # the report alone on stdout
    assert main(["--quiet"] + args + ["--out", str(tmp_path / "b")]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == captured.out.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    # the same report either way
    assert (tmp_path / "a" / "trace.md").read_text() == (tmp_path / "b" / "trace.md").read_text()


def test_progress_lines_are_logged_above_the_bar_and_quiet_hides_them(tmp_path, capsys, caplog):
    args = ["bench", "lookup", "--sizes", "100", "--queries", "5", "--recall-queries", "5", "--dim", "16"]
    with caplog.at_level(logging.INFO, logger="vismemo_hf.bench"):
        assert main(args + ["--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "lookup:" in err and "chunk" in err
    assert any(r.name == "vismemo_hf.bench.lookup" and "100 entries: median" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert main(["--quiet"] + args + ["--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""
    assert not [r for r in caplog.records if r.name.startswith("vismemo_hf.") and r.levelno < logging.WARNING]


def test_quiet_turns_the_other_libraries_bars_off_and_back_on():
    import huggingface_hub.utils
    from transformers.utils import logging as hf_logging

    progress.configure(quiet=True)
    assert not progress.enabled() and not hf_logging.is_progress_bar_enabled()
    assert huggingface_hub.utils.are_progress_bars_disabled()
    assert not logging.getLogger("vismemo_hf.eval.docqa").isEnabledFor(logging.INFO)
    progress.configure(quiet=False)
    assert progress.enabled() and hf_logging.is_progress_bar_enabled()
    assert not huggingface_hub.utils.are_progress_bars_disabled()
    assert logging.getLogger("vismemo_hf.eval.docqa").isEnabledFor(logging.INFO)
    assert logging.getLogger("vismemo_hf.runtime.watch").getEffectiveLevel() >= logging.WARNING  # runtime notes stay off


def test_vismemo_quiet_in_the_environment_does_what_quiet_does(tmp_path, capsys, monkeypatch):
    """Other libraries' bars too (transformers' "Loading weights" bar stayed on with VISMEMO_QUIET=1 alone)."""
    import huggingface_hub.utils
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("VISMEMO_QUIET", "1")
    try:
        assert main(["bench", "lookup", "--sizes", "100", "--dim", "16", "--queries", "5", "--recall-queries", "5",
                     "--out", str(tmp_path)]) == 0
        assert capsys.readouterr().err == ""
        assert not hf_logging.is_progress_bar_enabled() and huggingface_hub.utils.are_progress_bars_disabled()
    finally:
        progress.configure(quiet=False)


def test_a_log_line_during_a_bar_is_written_above_it():
    import io

    stream = io.StringIO()
    handler = progress._AboveBars(logging.StreamHandler(stream))
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    record = logging.LogRecord("vismemo_hf.eval.docqa", logging.INFO, __file__, 1, "step 50 qa 0.1", None, None)
    warning = logging.LogRecord("vismemo_hf.store.store", logging.WARNING, __file__, 1, "disk tier gone", None, None)
    with progress.progress(total=2, desc="train"):
        handler.emit(record)
        handler.emit(warning)
    assert stream.getvalue() == "step 50 qa 0.1\nWARNING vismemo_hf.store.store: disk tier gone\n"


def test_quiet_is_global_and_report_context_keeps_its_own():
    assert parser().parse_args(["--quiet", "bench", "trace"]).quiet_all
    assert parser().parse_args(["-q", "report", "context"]).quiet_all
    args = parser().parse_args(["report", "context", "--quiet"])
    assert args.quiet and not args.quiet_all
