"""The prompts of `pdserve bench serve`, drawn as vLLM's `vllm bench serve` draws them
(vllm/benchmarks/datasets.py: RandomDataset, PrefixRepetitionRandomDataset, ShareGPTDataset), seeded.

    random             prompt = [shared prefix of --random-prefix-len random ids] + a run of consecutive
                       vocabulary ids from a random start; input and output lengths uniform in
                       [len * (1 - ratio), len * (1 + ratio)] (--random-range-ratio)
    prefix_repetition  --prefix-repetition-num-prefixes random prefixes, each followed by random suffixes:
                       every prefix is shared by num_prompts / num_prefixes prompts, in shuffled order
    sharegpt           a ShareGPT JSON file: each entry's first turn is the prompt, the second's token count
                       its output length (or --sharegpt-output-len); vLLM's filter (prompt and output >= 4
                       tokens, prompt <= 1024, both <= 2048), sampled again when too few are left

Ids are drawn from the tokenizer's base vocabulary less its special tokens. A prompt goes as token ids
(as_text False: /v1/completions takes a list of ints, so its length is exact) or as the ids' text (chat).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "prefix_repetition", "sharegpt")
ALIASES = {"prefix": "prefix_repetition"}  # a shorter name for vLLM's


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens, by the tokenizer (the server's usage has the count it served)
    expected_output_len: int  # max_tokens


def _allowed_ids(tokenizer: Any) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [t for t in range(tokenizer.vocab_size) if t not in special]


def _prompt(tokenizer: Any, ids: list[int], as_text: bool) -> str | list[int]:
    return tokenizer.decode(ids) if as_text else ids


def _lengths(rng: random.Random, mean: int, ratio: float, num: int) -> list[int]:
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return [rng.randint(max(low, 1), max(high, 1)) for _ in range(num)]


def random_requests(
    tokenizer: Any,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
    as_text: bool,
) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    prefix = [rng.choice(allowed) for _ in range(prefix_len)]
    inputs = _lengths(rng, input_len, range_ratio, num)
    outputs = _lengths(rng, output_len, range_ratio, num)
    out = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        start = rng.randrange(len(allowed)) + i
        ids = prefix + [allowed[(start + k) % len(allowed)] for k in range(n_in)]
        out.append(SampleRequest(_prompt(tokenizer, ids, as_text), len(ids), n_out))
    return out


def prefix_repetition_requests(
    tokenizer: Any,
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
    as_text: bool,
) -> list[SampleRequest]:
    if num_prefixes < 1 or num < num_prefixes:
        raise ValueError(f"--num-prompts ({num}) must be at least --prefix-repetition-num-prefixes ({num_prefixes})")
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)

    def draw(n: int) -> list[int]:
        return [rng.choice(allowed) for _ in range(n)]

    out = []
    for _ in range(num_prefixes):
        prefix = draw(prefix_len)
        for _ in range(num // num_prefixes):
            ids = prefix + draw(suffix_len)
            out.append(SampleRequest(_prompt(tokenizer, ids, as_text), len(ids), output_len))
    rng.shuffle(out)
    return out


def _is_valid(prompt_len: int, output_len: int, has_fixed_output: bool) -> bool:
    """vLLM's is_valid_sequence with its defaults."""
    if prompt_len < 4 or (not has_fixed_output and output_len < 4):
        return False
    return prompt_len <= 1024 and prompt_len + output_len <= 2048


def sharegpt_requests(
    path: Path, tokenizer: Any, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """Text prompts from a ShareGPT file: [{"conversations": [{"from": "human", "value": ...}, {"from":
    "gpt", "value": ...}, ...]}, ...]."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a JSON list of ShareGPT entries expected")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or ()) >= 2]
    rng = random.Random(seed)
    rng.shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, completion = str(conv[0]["value"]), str(conv[1]["value"])
        prompt_len = len(tokenizer(prompt).input_ids)
        n_out = output_len if output_len is not None else len(tokenizer(completion).input_ids)
        if _is_valid(prompt_len, n_out, output_len is not None):
            out.append(SampleRequest(prompt, prompt_len, n_out))
    if not out:
        raise ValueError(f"--dataset-path {path}: no entry passes the length filter")
    return out + oversample(out, num - len(out), rng)


def oversample(requests: Sequence[SampleRequest], num: int, rng: random.Random) -> list[SampleRequest]:
    """num more requests drawn from requests (vLLM's maybe_oversample_requests)."""
    return [rng.choice(requests) for _ in range(max(num, 0))]
