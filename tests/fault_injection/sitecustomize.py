"""Fault injection for the servers of tests/pd/test_fault_injection.py (tests only).

A server started with this folder on its PYTHONPATH imports this module at start-up, and so do its rank
processes (they inherit the environment). It wraps one function per stage of a request so that it raises
InjectedFault, an exception the code does not expect, for a request whose id names that stage:
`X-Request-Id: fault-<stage>-<n>` gives engine request ids `chatcmpl-fault-<stage>-<n>-<choice>` on the
HTTP process, the PE and the CE alike. Stages (STAGES): where the request is admitted, where a token is
processed and masked, sampled (or fed on the device by launch-ahead), detokenized, where a PE exports the KV and a CE imports it, where the HTTP
process parses tool calls. A stage that comes for every token takes `first` (the first token: on a pair,
the PE's) or `later` (a later one: on a pair, the CE's), e.g. `fault-sample-later-3`.

The wrapping happens when the module that holds the function is imported (a meta path finder), so a
process imports nothing it would not import anyway.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

STAGES = (
    "admission",  # LLMEngine.add_request (the single engine, the PE)
    "reserve",  # the CE's reservation (engine.handoffs.enqueue)
    "mask-first",  # LLMEngine._process: logit processors and the grammar mask
    "mask-later",
    "sample-first",  # the draw (engine.execution.draw.sample) of the request's row
    "sample-later",
    "feed-later",  # LaunchAhead.feed: a greedy batch's tokens taken on the device (launch-ahead's fed path)
    "detok-first",  # LLMEngine._append_token: the token detokenized and checked for stops
    "detok-later",
    "export",  # LLMEngine.export_sequence (the PE)
    "import",  # LLMEngine.import_sequence (the CE)
    "toolparse",  # pd.api.chat.parse_tool_output (the HTTP process)
)


class InjectedFault(RuntimeError):
    pass


def _names(request_id: str, stage: str) -> bool:
    return f"fault-{stage}-" in request_id


def _token_stage(seq: Any, stage: str) -> bool:
    """seq's next token is the one `<stage>-first` or `<stage>-later` names."""
    which = "first" if not seq.output_token_ids else "later"
    return _names(seq.request_id, f"{stage}-{which}")


def _raise(where: str, request_id: str) -> None:
    raise InjectedFault(f"injected fault: {where} of {request_id}")


# ---- the wrappers, by module ----------------------------------------------------------------------

_drawing: list[Any] = []  # the sequences whose rows engine.execution.draw.sample is drawing (set by draw)


def _patch_engine(mod: ModuleType) -> None:
    cls = mod.LLMEngine
    add_request, append = cls.add_request, cls._append_token

    def add_request_(self: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        if _names(request_id, "admission"):
            _raise("admission", request_id)
        return add_request(self, request_id, *a, **kw)

    def append_(self: Any, seq: Any, *a: Any) -> Any:
        if _token_stage(seq, "detok"):
            _raise("detokenizing", seq.request_id)
        return append(self, seq, *a)

    cls.add_request, cls._append_token = add_request_, append_


def _patch_draw(mod: ModuleType) -> None:
    cls = mod.TokenDrawer
    process, draw, sample = cls._process, cls.draw, mod.sample

    def process_(self: Any, logits: Any, seqs: Sequence[Any]) -> Any:
        for s in seqs:
            if _token_stage(s, "mask"):
                _raise("logit processing", s.request_id)
        return process(self, logits, seqs)

    def draw_(self: Any, logits: Any, seqs: list[Any]) -> Any:
        _drawing[:] = seqs
        try:
            return draw(self, logits, seqs)
        finally:
            _drawing.clear()

    def sample_(logits: Any, params: list[Any], *a: Any, **kw: Any) -> Any:
        for s in _drawing:
            if any(p is s.params for p in params) and _token_stage(s, "sample"):
                _raise("sampling", s.request_id)
        return sample(logits, params, *a, **kw)

    cls._process, cls.draw, mod.sample = process_, draw_, sample_


def _patch_facade(mod: ModuleType) -> None:
    cls = mod.HandoffFacade
    export, import_ = cls.export_sequence, cls.import_sequence

    def export_(self: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        if _names(request_id, "export"):
            _raise("export", request_id)
        return export(self, request_id, *a, **kw)

    def import__(self: Any, exp: Any) -> Any:
        if _names(exp.request_id, "import"):
            _raise("import", exp.request_id)
        return import_(self, exp)

    cls.export_sequence, cls.import_sequence = export_, import__


def _patch_launch_ahead(mod: ModuleType) -> None:
    feed = mod.LaunchAhead.feed

    def feed_(self: Any, launched: Any) -> Any:
        for s in launched.seqs:
            if _token_stage(s, "feed"):
                _raise("feeding", s.request_id)
        return feed(self, launched)

    mod.LaunchAhead.feed = feed_


def _patch_ledger(mod: ModuleType) -> None:
    enqueue = mod.HandoffLedger.enqueue

    def enqueue_(self: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        if _names(request_id, "reserve"):
            _raise("reservation", request_id)
        return enqueue(self, request_id, *a, **kw)

    mod.HandoffLedger.enqueue = enqueue_


def _patch_chat(mod: ModuleType) -> None:
    from pd.http.request_log import REQUEST_ID

    parse = mod.parse_tool_output

    def parse_(*a: Any, **kw: Any) -> Any:
        if _names(REQUEST_ID.get() + "-", "toolparse"):
            _raise("tool-call parsing", REQUEST_ID.get())
        return parse(*a, **kw)

    mod.parse_tool_output = parse_


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "engine.engine": _patch_engine,
    "engine.execution.draw": _patch_draw,
    "engine.handoff.facade": _patch_facade,
    "engine.execution.launch_ahead": _patch_launch_ahead,
    "engine.handoff.ledger": _patch_ledger,
    "pd.api.chat": _patch_chat,
}


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds PATCHES' modules with the other finders, and patches each once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loaders = getattr(self, "_loaders", {})
        self._loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loaders[module.__name__].exec_module(module)
        PATCHES[module.__name__](module)


sys.meta_path.insert(0, _Patcher())
