"""junit.xml: one test case per cell, for CI test reporters (harness/ci/gate.py adds the reference
runs and the baseline checks).

- `time`: the seconds the cell ran in its launch's ranks (harness/run/orchestrate.py); a cell that
  broke its launch gets the launch's time after the cells before it, one never run 0.
- a failing cell is a `<failure>` whose message is its first divergence and whose text lists the
  first MAX_FAILURE_LINES violations; a crashed or hung cell an `<error>` with the ranks' output;
  a cell that cannot run here a `<skipped>` with the reason.
- the suite's `<properties>`: the run id, the command and the environment the run recorded.
"""

from __future__ import annotations

from xml.etree import ElementTree as ET

from harness.judge.result import Verdict
from harness.report.build import Report

MAX_FAILURE_LINES = 20


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def add_testcase(root: ET.Element, classname: str, name: str, time_s: float) -> ET.Element:
    return ET.SubElement(root, "testcase", classname=classname, name=name, time=f"{time_s:.3f}")


def add_cell_outcome(case: ET.Element, result) -> None:
    """The `<failure>` or `<error>` of a CellResult that did not pass."""
    cell_id = result.cell.cell_id
    if result.verdict == Verdict.FAIL:
        first = result.first_divergence
        ET.SubElement(case, "failure", message=first.describe(cell_id), type=first.check).text = "\n".join(
            v.describe(cell_id) for v in result.violations[:MAX_FAILURE_LINES])
    elif result.verdict == Verdict.ERROR:
        ET.SubElement(case, "error", message=_first_line(result.error), type="error").text = result.error


def recount(root: ET.Element) -> None:
    """The suite's tests/failures/errors/skipped attributes from its test cases."""
    cases = root.findall("testcase")
    root.set("tests", str(len(cases)))
    for tag, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        root.set(attr, str(sum(c.find(tag) is not None for c in cases)))


def render_junit(report: Report, suite: str = "fsdp-equivalence") -> str:
    root = ET.Element("testsuite", name=suite, time=f"{report.wall_s:.2f}")
    props = ET.SubElement(root, "properties")
    for name, value in [("run_id", report.run_id), ("command", report.command),
                        *((f"environment.{k}", v) for k, v in report.environment.items())]:
        ET.SubElement(props, "property", name=name, value="" if value is None else str(value))
    for r in report.cells:
        case = add_testcase(root, f"harness.{r.cell.case}", r.cell.cell_id, report.cell_wall_s.get(r.cell.cell_id, 0.0))
        add_cell_outcome(case, r)
    for cell, reason in report.skipped:
        case = add_testcase(root, f"harness.{cell.case}", cell.cell_id, 0.0)
        ET.SubElement(case, "skipped", message=reason)
    recount(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
