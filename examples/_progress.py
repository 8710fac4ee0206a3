"""Progress for the examples: a tqdm bar on a terminal (when tqdm is installed), plain lines otherwise.

Plain lines (logs, CI, pipes, or no tqdm) go to stderr about every 10 % of the run and at its end, with the
elapsed time, so a long run is never silent and a log stays short.
"""

import sys
import time


class _Lines:
    def __init__(self, total: int, desc: str, redraw: bool):
        self.total, self.desc, self.redraw = total, desc, redraw
        self.n, self.postfix, self.t0 = 0, "", time.perf_counter()
        self.every = max(1, total // 10)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.redraw or self.n % self.every == 0 or self.n == self.total or self.n == 1:
            line = f"{self.desc} {self.n}/{self.total}  {time.perf_counter() - self.t0:.1f} s"
            line += f"  {self.postfix}" if self.postfix else ""
            if self.redraw:
                print(f"\r{line}", end="", file=sys.stderr, flush=True)
            else:
                print(line, file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.redraw:
            print(file=sys.stderr)


def progress(total: int, desc: str = "step"):
    """An object with ``update(k=1)``, ``set_postfix_str(s)`` and ``close()``."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            return _Lines(total, desc, redraw=True)
    return _Lines(total, desc, redraw=False)
