"""Incremental detokenization and stop strings, on the real checkpoints' tokenizers."""

from __future__ import annotations

import pytest

from engine.checkpoints import resolve_model
from engine.core.detokenizer import IncrementalDetokenizer

TEXT = "Hello wörld! 東京は晴れ 🌤️ — naïve café, def f(x):\n    return x**2  # done."


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def tokenizer(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(request.param)))


def _stream(tok, ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop)
    deltas = []
    for t in ids:
        d.add(t)
        deltas.append(d.release(is_final=d.stopped_by is not None))
        if d.stopped_by is not None:
            break
    else:
        deltas.append(d.release(is_final=True))
    return deltas, d


def test_deltas_join_to_the_full_decode(tokenizer) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    deltas, _ = _stream(tokenizer, ids, ())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop", [("晴れ",), ("café", "f(x)"), ("**2",), ("nowhere",)])
def test_stop_strings_cut_and_never_leak(tokenizer, stop: tuple[str, ...]) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    deltas, d = _stream(tokenizer, ids, stop)
    text = "".join(deltas)
    hits = [full.find(s) for s in stop if s in full]
    if hits:
        assert d.stopped_by in stop and text == full[: min(hits)]
    else:
        assert d.stopped_by is None and text == full
    for i in range(len(deltas)):  # no prefix of the stream ever shows a stop string
        assert not any(s in "".join(deltas[: i + 1]) for s in stop)
