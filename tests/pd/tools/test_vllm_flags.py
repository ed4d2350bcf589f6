"""vLLM's flags on `pdserve serve` (issue 52): -tp/-dp and their long names, --enable-prefix-caching,
--generation-config, --trust-remote-code, --kv-transfer-config; and the checkpoint's generation_config.json
as the sampling defaults of a request that leaves them out."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.checkpoints import resolve_model
from pd.config import ServerConfig
from pd.frontend.sampling_defaults import sampling_defaults, with_defaults
from pd.tools.server_process import ServerProcess
from tests.pd.tools.test_cli import PDSERVE
from tests.server_fixtures import openai_client

MODEL = "smollm2-135m-instruct"


def _cfg(*argv: str) -> ServerConfig:
    return ServerConfig.from_argv(list(argv), "pdserve serve", is_model_positional=True)


def test_parallel_sizes_under_vllms_names() -> None:
    for argv in (["-tp", "2", "-dp", "3"], ["--tensor-parallel-size", "2", "--data-parallel-size", "3"]):
        cfg = _cfg(*argv)
        assert (cfg.tp, cfg.dp) == (2, 3)


def test_prefix_caching_switch(tmp_path: Path) -> None:
    assert _cfg().engine.enable_prefix_caching and _cfg().engine.uses_decode_cache
    off = _cfg("--no-enable-prefix-caching")
    assert not off.engine.enable_prefix_caching and not off.engine.uses_decode_cache
    (tmp_path / "c.yaml").write_text("enable-prefix-caching: false\n")
    assert not _cfg("--config", str(tmp_path / "c.yaml")).engine.enable_prefix_caching


def test_trust_remote_code_is_taken() -> None:
    assert _cfg("--trust-remote-code").trust_remote_code and not _cfg().trust_remote_code


def test_a_checkpoint_with_its_own_code_is_refused_by_name(tmp_path: Path) -> None:
    """config.json's auto_map for a model_type no family serves: refused naming it (no code runs here)."""
    from engine.errors import InvalidRequestError
    from engine.models.registry import load_hf_config

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "my_llm", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}})
    )
    with pytest.raises(InvalidRequestError, match="brings its own model code .*'my_llm'.*runs no code"):
        load_hf_config(tmp_path)


def _kv(text: dict[str, object], *argv: str) -> ServerConfig:
    return _cfg("--kv-transfer-config", json.dumps(text), *argv)


def test_kv_transfer_config_maps_onto_the_pd_flags() -> None:
    # nixl may be missing here (--transport nixl is refused then): a producer's connector is checked with nccl
    pe = _kv({"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer"})
    assert (pe.role, pe.transfer.transport) == ("pe", "nccl")
    ce = _kv({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_ip": "10.0.0.2", "kv_port": 14579})
    assert (ce.role, ce.kv_host, ce.kv_port_base) == ("ce", "10.0.0.2", 14579)
    both = _kv({"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}, "--role", "pe")
    assert (both.role, both.transfer.transport) == ("pe", "nccl")
    assert _kv({"kv_role": "kv_consumer"}, "--role", "ce").role == "ce"  # the same value twice is no conflict


def test_vllms_names_in_a_config_file(tmp_path: Path) -> None:
    """A vLLM YAML config: its keys are the flags' long names; a JSON setting as a YAML map."""
    (tmp_path / "c.yaml").write_text(
        "tensor-parallel-size: 2\ndata_parallel_size: 2\nkv-transfer-config: {kv_role: kv_producer}\n"
        "generation-config: vllm\ntrust-remote-code: true\n"
    )
    cfg = _cfg("--config", str(tmp_path / "c.yaml"))
    assert (cfg.tp, cfg.dp, cfg.role, cfg.transfer.transport) == (2, 2, "pe", "tcp")
    assert cfg.generation_config == "vllm" and cfg.trust_remote_code


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}, (), "kv_connector 'LMCacheConnectorV1' has no pdserve transport"),
        ({"kv_role": "kv_both"}, (), "add --role pe (prefill) or --role ce"),
        ({"kv_role": "kv_producer", "kv_buffer_size": 1e9}, (), "['kv_buffer_size'] have no counterpart"),
        ({"kv_role": "kv_producer", "kv_ip": "10.0.0.2"}, (), "kv_ip is where a decode engine receives KV"),
        ({"kv_role": "kv_producer"}, ("--role", "ce"), "says --role pe, but --role ce is given"),
        ({"kv_role": "prefill"}, (), "kv_role must be kv_producer, kv_consumer or kv_both"),
        ({"kv_role": "kv_consumer", "kv_port": "1"}, (), "kv_port must be an integer"),
    ],
)
def test_kv_transfer_config_refuses_what_has_no_counterpart(
    text: dict[str, object], argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError) as e:
        _kv(text, *argv)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="must be a JSON object"):
        _cfg("--kv-transfer-config", "NixlConnector")


def test_generation_config_values(tmp_path: Path) -> None:
    assert _cfg().generation_config == "auto" and _cfg("--generation-config", "vllm").generation_config == "vllm"
    with pytest.raises(ValueError, match="has none"):
        _cfg("--generation-config", str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{}")
    assert _cfg("--generation-config", str(tmp_path)).generation_config == str(tmp_path)


def test_sampling_defaults_of_a_generation_config(tmp_path: Path) -> None:
    """The five sampling fields vLLM takes, nothing else; `vllm` takes none; a request's own (not null) win;
    a beam search takes the temperature alone."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1,
                    "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2, "typical_p": 0.5})
    )  # fmt: skip
    defaults = sampling_defaults("auto", tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1}
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults(str(tmp_path), Path("/nowhere")) == defaults
    assert sampling_defaults("auto", resolve_model(MODEL)) == {}  # SmolLM2's file sets no sampling value
    body = with_defaults({"messages": [], "temperature": 1.0, "top_p": None}, defaults)
    assert body == {"messages": [], **defaults, "temperature": 1.0}
    assert with_defaults({"use_beam_search": True}, defaults) == {"use_beam_search": True, "temperature": 0.6}
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        sampling_defaults("auto", tmp_path)


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's converted checkpoint, its generation_config.json asking for greedy answers (temperature 0)."""
    src = resolve_model(MODEL)
    folder = tmp_path_factory.mktemp("greedy") / "smollm2-greedy"
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    return folder


@pytest.fixture(scope="module")
def vllm_server(greedy_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`pdserve serve FOLDER` with vLLM's flags, as a vLLM user types them."""
    with ServerProcess(
        "-tp", "1", "-dp", "1", "--no-enable-prefix-caching", "--trust-remote-code", "--generation-config", "auto",
        "--served-model-name", "greedy", "--kv-cache-gb", "0.1", "--max-model-len", "1024",
        command=(PDSERVE, "serve", str(greedy_checkpoint)),
        log_path=tmp_path_factory.mktemp("vllm-flags") / "server.log",
    ) as s:  # fmt: skip
        yield s


@pytest.mark.slow
def test_a_request_without_temperature_samples_at_the_checkpoints(vllm_server: ServerProcess) -> None:
    """generation_config.json's temperature 0: two answers without a temperature are the same greedy
    tokens; with a temperature of its own (and different seeds) a request samples; no prompt is cached."""
    client = openai_client(vllm_server.url, timeout_s=120)
    prompt = "Write a long story about a cat and a dog. " * 12  # past one KV block (128 tokens)

    def answer(**kw: object) -> tuple[str, int]:
        r = client.completions.create(model="greedy", prompt=prompt, max_tokens=24, **kw)  # type: ignore[call-overload]
        assert r.usage is not None
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        return r.choices[0].text, cached or 0

    (a, cached_a), (b, cached_b) = answer(), answer(seed=5)
    assert a == b and cached_a == cached_b == 0
    sampled = {answer(temperature=1.0, seed=s)[0] for s in range(3)}
    assert len(sampled) > 1
    log = vllm_server.log_tail(1 << 20)
    assert "sampling defaults of requests that do not set them, from generation_config.json: temperature=0.0" in log
    for phase in ("loading the weights of", "weights loaded in", "memory plan in"):  # the startup's progress
        assert phase in log


@pytest.mark.slow
def test_a_generation_config_outside_the_apis_range_stops_the_start(greedy_checkpoint: Path, tmp_path: Path) -> None:
    """A value no request could carry (temperature 5) is not a default: the server stops, naming it;
    --generation-config vllm serves the same checkpoint (not started here: the flag's check is above)."""
    hot = tmp_path / "hot"
    hot.mkdir()
    for f in greedy_checkpoint.iterdir():
        if f.name != "generation_config.json":
            (hot / f.name).symlink_to(f.resolve())
    (hot / "generation_config.json").write_text(json.dumps({"temperature": 5.0}))
    out = subprocess.run(
        [PDSERVE, "serve", str(hot), "--port", "0", "--kv-cache-gb", "0.05"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1
    assert "generation_config.json: 'temperature' must be in [0.0, 2.0], got 5.0 (--generation-config vllm" in out.stderr
