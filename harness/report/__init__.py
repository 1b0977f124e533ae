"""Reports, rendered by the parent from the judge's results: md, html, csv, json, JUnit."""
