"""Progress of long work (simulating a whole model's tiles): a tqdm bar on a terminal,
nothing otherwise, and a one-line summary at the end (on the terminal, and always to
the ``pypto_inductor`` logger at INFO)."""
from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger(__name__)


class Progress:
    """``with Progress(total, "simulating") as p: ... p.update(1, failed=...)``.

    Thread-safe (the simulator's workers report from threads). The bar goes to
    stderr when it is a terminal; ``PYPTO_INDUCTOR_PROGRESS=0`` turns it off.
    """

    def __init__(self, total: int, desc: str, unit: str = "tile", stream=None):
        import os

        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self._lock = threading.Lock()
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.enabled = tty and total > 0 and os.environ.get("PYPTO_INDUCTOR_PROGRESS") != "0"
        self._bar = None

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit,
                             file=self.stream, leave=False, dynamic_ncols=True)
        return self

    def update(self, n: int = 1, failed: int = 0) -> None:
        with self._lock:
            self.done += n
            self.failed += failed
            if self._bar is not None:
                self._bar.update(n)
                if self.failed:
                    self._bar.set_postfix(failed=self.failed, refresh=False)

    def summary(self) -> str:
        secs = time.monotonic() - self._start
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{self.desc}: {self.done}/{self.total} {self.unit}s{failed} in {secs:.1f} s"

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
            print(self.summary(), file=self.stream, flush=True)
        log.info("%s", self.summary())
