"""CUDA graphs for decode steps.

A decode step of an 8B model is a few hundred small kernels; launched one by one from Python they
take longer than the weights take to read. So each bucketed batch size gets one graph, captured once
at engine start, of the whole forward from the static decode buffers (engine/layers/decode.py) to the float32
logits. A step pads its rows up to the next bucket (padded rows have context length 0: the kernels skip
them and they store nothing), refills the buffers, replays, and hands back the logits of its real rows;
only the sampled token ids then travel to the host. Prefill and mixed steps run eagerly.

Graphs share one memory pool and are captured largest first, so the smaller ones reuse its blocks;
each graph's logits stay valid until the next replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache
from engine.core.sequence import Sequence
from engine.layers.context import forward_context
from engine.layers.decode import DecodeInputs, DecodeMeta
from engine.layers.numerics import Numerics
from engine.models.decoder import CausalLM

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets up to max_num_seqs (which is a bucket itself when it is at most the largest)."""
    sizes = [b for b in GRAPH_BATCH_SIZES if b < max_num_seqs]
    return sizes + [min(max_num_seqs, GRAPH_BATCH_SIZES[-1])]


@dataclass(frozen=True)
class GraphCaptureStats:
    batch_sizes: tuple[int, ...]
    verify_sizes: tuple[int, ...]  # speculative verifies' rows
    capture_s: float
    pool_bytes: int  # device memory reserved by the capture (the graphs' shared pool)


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, kv: KVCache, numerics: Numerics, inputs: DecodeInputs, config: ForwardConfig
    ) -> None:
        self.model, self.kv, self.numerics, self.inputs = model, kv, numerics, inputs
        self.config = config  # NOTE: captured into the graphs: replacing it later changes nothing
        # (rows, is a speculative verify) -> the graph, its hidden states and its logits
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.last_hidden: torch.Tensor | None = None  # the last replay's hidden states (its real rows)

    def _forward(self, meta: DecodeMeta) -> tuple[torch.Tensor, torch.Tensor]:
        with forward_context([], self.kv, self.numerics, decode=meta, config=self.config):
            hidden = self.model(meta.input_ids, meta.positions)
            return hidden, self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int], verify_sizes: list[int] | None = None) -> GraphCaptureStats:
        """batch_sizes: decode steps' rows; verify_sizes: speculative verifies' rows (a sequence's last token and
        its drafts, engine/layers/decode.py DecodeMeta.is_verify)."""
        device = self.inputs.device_buf.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        shapes = [(b, False) for b in set(batch_sizes)] + [(b, True) for b in set(verify_sizes or [])]
        for b, is_verify in sorted(shapes, reverse=True):
            meta = self.inputs.fill([], b, is_verify)  # every row padded: nothing is stored
            # Warm-up outside the graph: compiles the Triton kernels and lets cuBLAS pick this shape's algorithm.
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(meta)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits = self._forward(meta)
            self._graphs[(b, is_verify)] = (graph, hidden, logits)
        torch.cuda.synchronize(device)
        return GraphCaptureStats(
            batch_sizes=tuple(sorted(b for b, v in self._graphs if not v)),
            verify_sizes=tuple(sorted(b for b, v in self._graphs if v)),
            capture_s=time.perf_counter() - t0,
            pool_bytes=torch.cuda.memory_reserved(device) - before,
        )

    def bucket(self, num_rows: int, is_verify: bool = False) -> int | None:
        return min((b for b, v in self._graphs if v == is_verify and b >= num_rows), default=None)

    def run(self, seqs: list[Sequence], fed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of one decode step of seqs (every one a decode row), one row per sequence and one
        more per draft it has (a speculative verify); fed_ids: their input tokens on the device (the last
        step's, not yet on the host) instead of their last."""
        num_rows = sum(1 + len(s.draft_token_ids) for s in seqs)
        is_verify = num_rows > len(seqs)
        b = self.bucket(num_rows, is_verify)
        if b is None:
            raise ValueError(f"no graph for {num_rows} rows (verify: {is_verify})")
        meta = self.inputs.fill(seqs, b, is_verify)
        if fed_ids is not None:
            meta.input_ids[: len(seqs)].copy_(fed_ids)  # NOTE: queued after fill's copy, before the replay
        graph, hidden, logits = self._graphs[(b, is_verify)]
        graph.replay()
        self.last_hidden = hidden[:num_rows]
        return logits[:num_rows]
