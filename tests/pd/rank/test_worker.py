"""What a rank process is told (pd/rank/worker.py): its engine and role configs, typed and strict."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.codec import WireError, to_wire
from pd.config import ServerConfig
from pd.rank.worker import engine_config as rank_engine_config
from pd.rank.worker import read_configs


def test_rank_configs_are_typed_and_strict():
    """What a rank is told (--engine-config, --role-config): the codec's encoding of EngineConfig and
    RoleConfig, decoded as it was sent; an unknown, renamed or mistyped key is an error."""
    cfg = ServerConfig.from_argv(
        ["--role", "ce", "--deterministic", "--prefill-sdpa", "off", "--kv-cache-gb", "1", "--quantization", "fp8"]
    )
    assert cfg.engine.quantization == "fp8"
    engine_json, role_json = json.dumps(to_wire(cfg.engine)), json.dumps(to_wire(cfg.role_config(1)))
    assert read_configs(engine_json, role_json) == (cfg.engine, cfg.role_config(1))
    assert read_configs(engine_json, None) == (cfg.engine, None)
    good = to_wire(cfg.engine)
    for bad in (
        {**good, "max_num_seq": 3},
        {**good, "deterministic": True},  # the old name of is_deterministic
        {**good, "max_num_seqs": "3"},
        {**good, "forward": {"prefill_sdpa": "fast"}},
        {**good, "forward": {"chain_residual": False}},
    ):
        with pytest.raises(WireError):
            read_configs(json.dumps(bad), None)
    with pytest.raises(WireError):
        read_configs(engine_json, json.dumps({**to_wire(cfg.role_config(0)), "transport": "tcp"}))
    threads = torch.get_num_threads()
    try:
        device = f"cuda:{1 % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        assert rank_engine_config(cfg.engine, 1, 2) == dataclasses.replace(cfg.engine, device=device)
    finally:
        torch.set_num_threads(threads)


SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'


def test_speculative_config_reaches_every_rank():
    """--speculative-config (a str | None setting) reaches the ranks of every role as it was given (every
    rank is sent the same EngineConfig: rank/client.py); a value the engine's config refuses is refused
    again when a rank decodes it, never dropped."""
    for role in ("single", "pe", "ce"):
        cfg = ServerConfig.from_argv(["--role", role, "--dp", "2", "--speculative-config", SPEC])
        engine, _ = read_configs(json.dumps(to_wire(cfg.engine)), None)
        assert engine == cfg.engine and engine.speculative_config == SPEC
        assert engine.speculative() == cfg.engine.speculative() and engine.speculative() is not None
    plain, _ = read_configs(json.dumps(to_wire(ServerConfig.from_argv([]).engine)), None)
    assert plain.speculative_config is None and plain.speculative() is None
    good = to_wire(ServerConfig.from_argv([]).engine)
    for bad in ('{"method": "ngram"}', '{"method": "ngram", "num_speculative_tokens": 3, "k": 1}', "{", 3):
        with pytest.raises(WireError, match="speculative"):
            read_configs(json.dumps({**good, "speculative_config": bad}), None)
