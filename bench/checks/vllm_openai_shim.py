"""What vLLM's OpenAI-server tests import, standing in for vLLM, when bench/checks/vllm_openai_tests.py runs
them against pdserve. The runner copies this file into the run's temporary tree as `_pdserve_shim.py`;
`tests/utils.py` and the conftests there re-export it. Nothing here imports the project (the tree's
`tests` package is vLLM's, not ours): the runner passes what it needs in the environment:

    PDSERVE_SHIM_CMD        the server command before `serve` flags, JSON list (default ["pdserve"])
    PDSERVE_SHIM_MODEL_DIR  the served model's folder (config.json, tokenizer.json): every checkpoint name
                            a test gives (Qwen/..., HuggingFaceH4/...) is read from it
    PDSERVE_SHIM_LOG_DIR    where each server's log goes
    VLLM_SHIM_VERSION       the vLLM version the tests came from

- `RemoteOpenAIServer(model, args)`: starts `pdserve serve --port P --served-model-name MODEL` (the test's
  model name, or its `--served-model-name`), default flags otherwise: every other vLLM flag is ignored
  (printed). Same methods as vLLM's: url_root, url_for, get_client, get_async_client, show_hidden_metrics.
- `install_stubs()`: `import vllm...` finds stand-ins (any name resolves to a placeholder class), except a
  few real ones: get_tokenizer (the served model's tokenizer), the version, get_open_port, hf_api (a fake
  path, never downloaded), ModelConfig.get_vocab_size; `fastapi` likewise, `pybase64` is `base64`; and
  transformers' AutoTokenizer / AutoConfig read a hub name from the served model's folder.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

STUBBED = ("vllm", "fastapi")
PLAIN = "plain-vllm-placeholder"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_dir() -> str:
    return os.environ.get("PDSERVE_SHIM_MODEL_DIR", str(Path.home() / ".cache/pdserve/models/smollm2-135m-instruct"))


# ---- vLLM's test server, as pdserve ----------------------------------------------------------------


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values of a vLLM flag (`--f v1 v2` or `--f=v`), nargs '+' as vLLM's --served-model-name."""
    out: list[str] = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag:
            for v in args[i + 1:]:
                if v.startswith("--"):
                    break
                out.append(v)
    return out


class RemoteOpenAIServer:
    """vLLM's tests/utils.py RemoteOpenAIServer, starting pdserve with default flags."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict[str, Any] | None = None, **_: Any) -> None:
        args = [str(a) for a in vllm_serve_args]
        names = _flag_values(args, "--served-model-name")
        self.model = model
        self.served_model_name = names[0] if names else model
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version") for a in args)
        self.uds = None
        self.host = "127.0.0.1"
        self.port = free_port()
        cmd = [*json.loads(os.environ.get("PDSERVE_SHIM_CMD", '["pdserve"]')), "serve",
               "--port", str(self.port), "--served-model-name", self.served_model_name]  # fmt: skip
        log_dir = Path(os.environ.get("PDSERVE_SHIM_LOG_DIR", "."))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        print(f"[shim] {' '.join(cmd)}  (vLLM's `serve {model} {' '.join(args)}` asked; flags ignored)")
        env = {**os.environ, **(env_dict or {})}
        with open(self.log_path, "ab") as log:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        try:
            self._wait_ready(max_wait_seconds or 480)
        except BaseException:
            self._shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(self.url_for("health"), timeout=2) as r:
                    body = json.loads(r.read() or b"{}")
                    if r.status == 200 and all(x.get("state") != "starting" for x in body.get("ranks", [])):
                        return
            time.sleep(0.5)
        raise RuntimeError(f"pdserve not ready in {timeout_s} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def _shutdown(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shutdown()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


class LocalAssetServer:
    """vLLM's tests/conftest.py asset server, serving nothing (only multimodal cases use it)."""

    def url_for(self, name: str) -> str:
        return f"http://127.0.0.1:9/{name}"


# ---- vLLM's modules, stood in for --------------------------------------------------------------------


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls) -> Any:
        return iter(())


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(f"{type(self).__qualname__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


def stub(name: str) -> Any:
    """A placeholder for a vLLM name: a class (subclassable, callable, any attribute a placeholder)."""
    return _StubMeta(name, (_Stub,), {"__qualname__": name, "__module__": PLAIN})


def _get_tokenizer(*args: Any, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


class _HfApi:
    def snapshot_download(self, repo_id: str = "", **kwargs: Any) -> str:
        return f"/nonexistent/{repo_id}"


class _ModelConfig:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_vocab_size(self) -> int:
        return int(json.loads((Path(model_dir()) / "config.json").read_text())["vocab_size"])


def _version() -> str:
    return os.environ.get("VLLM_SHIM_VERSION", "0.0.0")


def _prev_minor_version() -> str:
    major, minor = (_version().split(".") + ["0"])[:2]
    return f"{major}.{max(int(minor) - 1, 0)}"


REAL: dict[str, Any] = {
    "vllm.tokenizers.get_tokenizer": _get_tokenizer,
    "vllm.transformers_utils.tokenizer.get_tokenizer": _get_tokenizer,
    "vllm.transformers_utils.repo_utils.hf_api": _HfApi,
    "vllm.utils.network_utils.get_open_port": free_port,
    "vllm.utils.get_open_port": free_port,
    "vllm.config.ModelConfig": _ModelConfig,
    "vllm.version._prev_minor_version": _prev_minor_version,
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in REAL:
            return REAL[full]
        if any(k.startswith(full + ".") for k in REAL):  # `from vllm import version`: the module
            return importlib.import_module(full)
        value = stub(full)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = _StubModule(spec.name)
        module.__path__ = []
        if spec.name in ("vllm", "vllm.version"):
            module.__version__ = _version()
        return module

    def exec_module(self, module: Any) -> None:
        pass


def _local_first(loader: Any) -> Any:
    """AutoTokenizer/AutoConfig.from_pretrained, a hub name read from the served model's folder."""
    original = loader.from_pretrained.__func__

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(name, (str, os.PathLike)) and Path(name).is_dir()):
            name = model_dir()
            kwargs.pop("revision", None)
        return original(cls, name, *args, **kwargs)

    return classmethod(from_pretrained)


def install_stubs() -> None:
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    import base64

    sys.modules.setdefault("pybase64", base64)
    with contextlib.suppress(ImportError):
        import transformers

        for name in ("AutoTokenizer", "AutoConfig"):
            cls = getattr(transformers, name)
            cls.from_pretrained = _local_first(cls)
