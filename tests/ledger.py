"""The suite's time ledger: seconds per test module in the last full run of ``make test``.

``make test`` runs the modules on two workers (pytest-xdist, one module per worker at a time).
The conftest hands them out longest first, by this ledger, so that no long module starts last
and runs alone at the end; a module missing from the ledger (a new one) goes first. Each change
that adds or removes test time says so by updating the ledger from the run's JUnit report:

    make test PYTEST_ARGS="--junitxml=/tmp/suite.xml -o junit_duration_report=total"
    .venv/bin/python -m tests.ledger /tmp/suite.xml

which rewrites tests/ledger.json and prints the modules with their change in seconds.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _pytest.reports import TestReport

LEDGER = Path(__file__).with_name("ledger.json")


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """Seconds per test module (setup, call and teardown) in a JUnit report."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        seconds[module] += float(case.get("time", 0))
    return {module: round(value, 1) for module, value in seconds.most_common()}


def report_seconds(reports: Iterable[TestReport]) -> dict[str, float]:
    """Seconds per test module in a run's reports (setup, call and teardown of each test)."""
    seconds: Counter[str] = Counter()
    for report in reports:
        seconds[Path(report.nodeid.split("::")[0]).stem] += report.duration
    return {module: round(value, 1) for module, value in seconds.most_common()}


def module_table(seconds: dict[str, float]) -> str:
    """The modules of a run with their seconds and the change against the ledger, as text."""
    before = recorded()
    lines = [f"{'module':32s} {'seconds':>8s} {'ledger':>8s}"]
    for module, now in sorted(seconds.items(), key=lambda item: -item[1]):
        then = before.get(module)
        lines.append(f"{module:32s} {now:8.0f} {'new' if then is None else f'{then:.0f}':>8s}")
    then = sum(before.get(module, 0.0) for module in seconds)
    lines.append(f"{'total':32s} {sum(seconds.values()):8.0f} {then:8.0f}")
    return "\n".join(lines)


def recorded() -> dict[str, float]:
    """The ledger's seconds per module; empty when there is none."""
    if not LEDGER.is_file():
        return {}
    return json.loads(LEDGER.read_text())["modules"]


def module_order(module: str, ledger: dict[str, float]) -> float:
    """Sort key that puts the longest modules first and unrecorded ones before them."""
    return -ledger.get(module, float("inf"))


def update(junit_xml: Path, wall_s: float) -> str:
    """Rewrite the ledger from a report; the table of modules with their change, as text."""
    before = recorded()
    after = module_seconds(junit_xml)
    LEDGER.write_text(json.dumps({"wall_s": round(wall_s), "modules": after}, indent=1) + "\n")
    lines = [f"{'module':32s} {'seconds':>8s} {'change':>8s}"]
    for module in sorted(set(before) | set(after), key=lambda name: -after.get(name, 0)):
        now, then = after.get(module, 0.0), before.get(module, 0.0)
        lines.append(f"{module:32s} {now:8.0f} {now - then:+8.0f}")
    lines.append(f"{'total (summed over workers)':32s} {sum(after.values()):8.0f}")
    return "\n".join(lines)


def suite_wall_seconds(junit_xml: Path) -> float:
    """The run's wall time, as pytest wrote it into the report."""
    suite = ET.parse(junit_xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return float(suite.get("time", 0)) if suite is not None else 0.0


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python -m tests.ledger JUNIT_XML  (a report of a full make test run)")
        return 2
    report = Path(argv[0])
    print(update(report, suite_wall_seconds(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
