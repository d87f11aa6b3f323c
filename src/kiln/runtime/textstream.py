"""Incremental detokenization with stop-sequence detection.

Tokens are decoded one at a time with the tokenizer's streaming decoder (which
waits until a multi-byte character is complete). Stop sequences are checked on
the decoded text; when one appears the text is cut just before it. While stop
sequences are set, the last ``len(longest stop) - 1`` characters are held back
from streaming, because they could be the start of a stop sequence that the next
token completes.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._backend = tokenizer.backend_tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all decoded text so far (after a stop: cut before it)
        self._emitted = 0  # characters already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text that may be released now (possibly "")."""
        piece = self._decoder.step(self._backend, token_id)
        if piece:
            start = max(0, len(self.text) - self._hold)
            self.text += piece
            if self._stop:
                window = self.text[start:]
                cut = min((i for i in (window.find(s) for s in self._stop) if i >= 0), default=-1)
                if cut >= 0:
                    self.text = self.text[: start + cut]
                    self.stopped = True
                    return self.flush()
        return self._release(len(self.text) - self._hold)

    def flush(self) -> str:
        """Release everything decoded (call when the row finishes)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
