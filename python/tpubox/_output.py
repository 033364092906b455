"""Output sinks: where a guest run's streamed stdout and stderr go as they arrive
(``Session.run``), to a text or a binary file object, or nowhere (capture only).
"""

from __future__ import annotations

import codecs
import io
from typing import Any


class Sink:
    """Writes a guest's output bytes to a text or binary file object as they arrive (text:
    decoded as UTF-8 across chunk boundaries, bad bytes replaced), flushing each time."""

    def __init__(self, f: Any):
        self.f = f if f is not False else None
        self.binary = False
        if self.f is not None and not isinstance(self.f, io.TextIOBase):
            mode = getattr(self.f, "mode", "")
            self.binary = isinstance(self.f, (io.RawIOBase, io.BufferedIOBase)) or (
                isinstance(mode, str) and "b" in mode
            )
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> None:
        if self.f is None:
            return
        if self.binary:
            self.f.write(data)
        else:
            text = self.decoder.decode(data)
            if text:
                self.f.write(text)
        try:
            self.f.flush()
        except Exception:
            pass

    def finish(self) -> None:
        if self.f is None or self.binary:
            return
        text = self.decoder.decode(b"", final=True)
        if text:
            self.f.write(text)
