"""Prompt lookup (vLLM's "ngram" method): the draft is what followed the latest earlier occurrence of
the sequence's last n tokens, n from max_n down to min_n (the longest match wins). No weights: it pays
where the output quotes its context (tool results, code edits, documents echoed back).

The search runs in C: the tokens as 4-byte words, the suffix found with bytes.rfind (a hit that does
not start on a word boundary is searched past)."""

from __future__ import annotations

from array import array


def ngram_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of tokens' longest suffix of min_n..max_n
    tokens (where they run into the suffix, the copy goes on from the draft itself: a repeating tail
    drafts its next k); [] when none occurred before."""
    num = len(tokens)
    if k < 1 or num < min_n + 1:
        return []
    hay = array("i", tokens).tobytes()
    # an occurrence must end before the last token, so that at least one token follows it
    end = (num - 1) * 4
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pat = hay[(num - n) * 4 :]
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
