"""A caller's `stop` strings, applied to the reply as OpenAI and vLLM apply them: the text up to the first stop
string, the stop string itself left out (the server's replies and the Python API's `Session.generate` / `chat`).

The engine stops generating at a stop string (it is in the text it decoded) but hands out everything it decoded, the
stop string included, because the chat REPL shows it. A streamed reply cannot take back a delta once sent, so text
that may be the start of a stop string is held back until the next piece shows that it is not (or the reply ends).
"""

from __future__ import annotations

from typing import Sequence


class StopText:
    """Feed it the reply's pieces as they decode; it returns what can be sent now."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # decoded, not sent yet: it may be the start of a stop string
        self.sent: list[str] = []
        self.hit = False  # a stop string was found: nothing after it is ever sent

    @property
    def text(self) -> str:
        """Everything sent so far (after `finish`: the whole reply the client gets)."""
        return "".join(self.sent)

    def add(self, piece: str) -> str:
        """The text that can be sent after `piece` ("" while it is held back, or after a stop string)."""
        if self.hit or not piece:
            return ""
        buf = self.held + piece
        at = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.hit, self.held = True, ""
            return self._send(buf[:at])
        keep = self._partial(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return self._send(buf[:len(buf) - keep])

    def finish(self) -> str:
        """The reply ended without a stop string: what was held back is text after all."""
        out, self.held = ("" if self.hit else self.held), ""
        return self._send(out)

    def _partial(self, buf: str) -> int:
        """The length of the longest tail of `buf` that is a proper start of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def _send(self, text: str) -> str:
        if text:
            self.sent.append(text)
        return text
