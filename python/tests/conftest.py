"""pytest's skips in the run's closing list: at the end of a session every skipped test or test file
is appended, as `SKIPPED: <file>[::<test>]: <why>`, to the file GRADBUS_SKIP_LOG names, beside the
Rust tests' skips (tests/common/skip.rs); scripts/test.sh prints the list at its end."""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("GRADBUS_SKIP_LOG")
    if not path:
        return
    lines = []
    for report in terminalreporter.stats.get("skipped", []):
        file, _, test = report.nodeid.partition("::")
        where = os.path.relpath(terminalreporter.config.rootpath / file, REPO) + (f"::{test}" if test else "")
        # A skip's longrepr is (file, line, "Skipped: <why>").
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        lines.append(f"SKIPPED: {where}: {why.removeprefix('Skipped: ')}\n")
    # One write in append mode, as the Rust tests write their lines.
    with open(path, "a") as f:
        f.write("".join(lines))
