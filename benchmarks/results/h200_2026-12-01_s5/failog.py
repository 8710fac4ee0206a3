"""pytest plugin: append every failed report (node id + traceback) to $OUT/failures.txt as it arrives."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.path.join(os.environ.get("OUT", "."), "failures.txt"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
