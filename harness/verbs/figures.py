"""`python -m harness figures`: the measured-figures table of docs/measured.md, generated from
reports/ (harness/report/figures.py); --check says whether the document is what reports/ says."""

from __future__ import annotations

from pathlib import Path

NAME = "figures"
IMPORTS_PROJECT = False
TAKES_EXTRA = False


def add_parser(verbs) -> None:
    p = verbs.add_parser("figures", help="regenerate the measured-figures table of docs/measured.md from reports/")
    p.add_argument("--reports", default="reports", help="the report sets to read (default reports)")
    p.add_argument("--doc", default="docs/measured.md", help="the document holding the table (default docs/measured.md)")
    p.add_argument("--check", action="store_true", help="change nothing; fail (exit 1) where the table is stale")


def run(args, extra: list[str], argv: list[str]) -> bool:
    from harness.errors import UserError
    from harness.report.figures import figures, with_table

    reports, doc = Path(args.reports), Path(args.doc)
    if not reports.is_dir():
        raise UserError(f"--reports {reports}: no such directory")
    try:
        text = doc.read_text()
        updated = with_table(text, figures(reports))
    except OSError as e:
        raise UserError(f"--doc {doc}: {e.strerror}") from None
    except ValueError as e:
        raise UserError(f"--doc {doc}: {e}") from None
    if args.check:
        print(f"{doc}: the figures table is {'up to date' if updated == text else 'stale: run python -m harness figures'}")
        return updated == text
    if updated != text:
        doc.write_text(updated)
    print(f"{doc}: {len(figures(reports))} figures from {reports}")
    return True
