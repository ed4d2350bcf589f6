"""Prompt lookup (vLLM's "ngram" method): the draft is what followed the latest earlier occurrence of
the sequence's last n tokens, n from max_n down to min_n (the longest match wins). No weights: it pays
where the output quotes its context (tool results, code edits, documents echoed back).

The search runs in C: a sequence's tokens as 4-byte words in a bytearray that grows with its output
(`Haystack`, kept per sequence: a step copies only its new tokens), the suffix found with
bytearray.rfind (a hit that does not start on a word boundary is searched past)."""

from __future__ import annotations

from array import array


class Haystack:
    """A sequence's tokens as 4-byte words, appended to as it grows."""

    def __init__(self) -> None:
        self.words = bytearray()
        self.tokens: list[int] = []

    def extend(self, new: list[int]) -> None:
        self.tokens += new
        self.words += array("i", new).tobytes()

    def draft(self, min_n: int, max_n: int, k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest suffix of min_n..max_n
        tokens (where they run into the suffix, the copy goes on from the draft itself: a repeating tail
        drafts its next k); [] when none occurred before."""
        tokens, hay = self.tokens, self.words
        num = len(tokens)
        if k < 1 or num < min_n + 1:
            return []
        end = (num - 1) * 4  # an occurrence ends before the last token: at least one token follows it
        for n in range(min(max_n, num - 1), min_n - 1, -1):
            pat = bytes(hay[(num - n) * 4 :])
            at = hay.rfind(pat, 0, end)
            while at > 0 and at % 4:
                at = hay.rfind(pat, 0, at + len(pat) - 1)
            if at >= 0:
                # copied on past the end, as LZ77 does: a match just before the suffix continues a loop
                first = at // 4 + n
                out: list[int] = []
                for i in range(first, first + k):
                    out.append(tokens[i] if i < num else out[i - num])
                return out
        return []


def ngram_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Haystack.draft over tokens (a one-off search)."""
    hay = Haystack()
    hay.extend(tokens)
    return hay.draft(min_n, max_n, k)
