"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte character waits for
the next, and while stop strings are set the last (longest stop - 1) characters are held back,
since they could still begin a stop string.

A fast tokenizer decodes through the `tokenizers` library's own DecodeStream: 1.3-2.1 us a token with
this class's bookkeeping, against 6.0-6.8 us for re-decoding a window of ids per token
(bench/micro/detok.py, 4,096 tokens, the same text); other tokenizers through the window.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded text so far
        self.emitted = 0  # characters of text already released
        self.stopped_by: str | None = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        """Appends a token; sets stopped_by if the text now contains a stop string."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)  # None until a character is whole
            if piece:
                self.text += piece
        else:
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, self.stopped_by = min(hits)
                self.text = self.text[:cut]

    def release(self, is_final: bool) -> str:
        """Text that can be shown now; everything left when is_final."""
        end = len(self.text)
        if not is_final and self.stop and self.stopped_by is None:
            end = max(self.emitted, end - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
