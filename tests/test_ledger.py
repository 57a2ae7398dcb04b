"""The time ledger that orders the suite's modules for make test's workers."""

from __future__ import annotations

from pathlib import Path

from _pytest.reports import TestReport

from tests import ledger

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="30.5">
<testcase classname="tests.test_a" name="one" time="1.25" />
<testcase classname="tests.test_a" name="two" time="2.0" />
<testcase classname="tests.test_b" name="one" time="20.0" />
</testsuite></testsuites>"""


def test_a_report_sums_each_module_and_gives_the_wall_time(tmp_path: Path) -> None:
    report = tmp_path / "suite.xml"
    report.write_text(REPORT)
    assert ledger.module_seconds(report) == {"test_b": 20.0, "test_a": 3.2}
    assert ledger.suite_wall_seconds(report) == 30.5


def test_a_runs_reports_give_each_modules_seconds_beside_the_ledger() -> None:
    """What the end of every run prints: setup, call and teardown summed per module."""

    def report(nodeid: str, when: str, duration: float) -> TestReport:
        return TestReport(nodeid, ("", 0, ""), {}, "passed", None, when, [], duration)

    reports = [
        report("tests/test_a.py::one", "setup", 0.5),
        report("tests/test_a.py::one", "call", 2.0),
        report("tests/test_b.py::two[x]", "call", 7.25),
        report("tests/test_a.py::three", "teardown", 1.0),
    ]
    seconds = ledger.report_seconds(reports)
    assert seconds == {"test_b": 7.2, "test_a": 3.5}
    table = ledger.module_table({**seconds, "test_unrecorded_module": 1.0}).splitlines()
    assert table[1].split()[:2] == ["test_b", "7"] and table[2].split()[:2] == ["test_a", "4"]
    assert table[3].split() == ["test_unrecorded_module", "1", "new"]
    assert table[-1].startswith("total")


def test_modules_go_longest_first_and_unrecorded_ones_before_them() -> None:
    seconds = {"test_short": 3.0, "test_long": 300.0}
    names = ["test_short", "test_long", "test_new"]
    assert sorted(names, key=lambda name: ledger.module_order(name, seconds)) == [
        "test_new",
        "test_long",
        "test_short",
    ]


def test_the_ledger_records_every_test_module() -> None:
    """A module missing from the ledger runs first; one that stays missing is a ledger that was
    not updated after the module was added (see tests/ledger.py)."""
    modules = {path.stem for path in Path(ledger.__file__).parent.glob("test_*.py")}
    assert modules - set(ledger.recorded()) == set()
