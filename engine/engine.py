"""LLMEngine: the public face of the engine. add_request / abort / step, plus export and import of a
sequence's memory (the P/D handoff is built on these two: engine/handoff/facade.py).

Here: the constructor, admission (validate, add_request, abort) and the step loop (schedule, run the
model, draw tokens, append and detokenize; a failure ends only the request(s) it came from). The rest is
composed in, one job a module, from the rooms below (engine/core, layers, models, execution, handoff);
engine/faults.py says which failures are fatal: those propagate and the rank exits.

In a tensor-parallel group (engine/parallel/tensor_parallel.py) every rank builds the same engine on its share
of the model; rank 0 serves (add_request, step, ...) and broadcasts each forward's plan, and the others
call follow(), which runs those forwards until rank 0 closes(). With --ep too (engine/parallel/world.py) rank 0 also
tells them of its empty MoE exchanges and expert rebalancing, and gathers their MoE counters for stats().
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from functools import partial
from pathlib import Path

import torch

from engine.arch import ModelArch
from engine.config import MAX_DEFAULT_MODEL_LEN, EngineConfig, EngineStats
from engine.core import kv_events
from engine.core.block_pool import BlockPool
from engine.core.decode_cache import DecodeCache
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.grammar import GrammarCompiler
from engine.core.host_prefix_cache import HostPrefixCache
from engine.core.kv_cache import KVCache, layout_of
from engine.core.prompt_logprobs import PromptLogprobsCollector
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import SeqStatus, Sequence
from engine.errors import InvalidRequestError
from engine.execution.cuda_graphs import GraphCaptureStats, graph_batch_sizes
from engine.execution.draw import TokenDrawer
from engine.execution.engine_stats import MoeCounters, engine_stats, group_moe_counters
from engine.execution.launch_ahead import LaunchAhead, LaunchedBatch
from engine.execution.memory_plan import plan_memory
from engine.execution.runner import ModelRunner, StepPlan
from engine.faults import raise_if_fatal
from engine.handoff import SequenceExport
from engine.handoff.facade import HandoffFacade
from engine.handoff.kv_shards import KVShards
from engine.handoff.ledger import HandoffLedger, Phase
from engine.handoff.pages import HandoffIO
from engine.layers.attention import preload_sdpa
from engine.layers.eplb import RebalanceStats, rebalance_model
from engine.layers.numerics import pick_numerics
from engine.models.hf_config import generation_eos_ids
from engine.models.loader import build_model
from engine.models.registry import arch_from_hf, load_hf_config
from engine.parallel import expert_parallel
from engine.parallel.tensor_parallel import (
    PLAN_COPY,
    PLAN_COUNTERS,
    PLAN_EXCHANGE,
    PLAN_EXPORT,
    PLAN_IDLE,
    PLAN_IMPORT,
    PLAN_REBALANCE,
    PLAN_STEP,
    PLAN_STOP,
    TensorGroup,
)
from engine.quantization import fp8_format
from engine.request import RequestOutput, SamplingParams, TokenLogprob, check_request, check_seed
from engine.speculative import setup as speculative

log = logging.getLogger(__name__)
# what a client hears of a failure that is not its request's fault (the log has the exception)
FAILED = "the engine failed while {phase} this request (the server's log has why, under the request's id)"


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorGroup | None = None) -> None:
        """tp: this rank's tensor-parallel group (`--tp N`; every rank of it builds its engine at once)."""
        from engine.checkpoints import load_tokenizer, resolve_model

        if tp is not None:  # NOTE: the forwards follow rank 0's plans: nothing launched ahead of them
            config = dataclasses.replace(config, launch_ahead=False)
        self.tp = tp
        self.config = config
        self.model_name = config.model
        folder = resolve_model(config.model, config.revision, config.download_dir)
        self.folder: Path = folder
        hf = load_hf_config(folder)
        self.arch: ModelArch = arch_from_hf(hf)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids: set[int] = generation_eos_ids(folder, hf)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.drawer = TokenDrawer(self.eos_token_ids)
        self.max_model_len = config.max_model_len or min(self.arch.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        self.fp8_format = fp8_format(getattr(hf, "quantization_config", None), config.quantization)
        mtp_layers = speculative.mtp_layers(config, self.arch, tp is not None)
        self.model = build_model(
            self.arch, hf, folder, self.dtype, self.device, self.max_model_len + 1, config.load_format == "dummy",
            config.seed, self.fp8_format, tp, mtp_layers=mtp_layers,
        )
        # --speculative-config draft_model: a second model, its KV in the pool's pages (engine/speculative/draft_model.py)
        self.draft_model, draft_layout = speculative.load_draft_model(
            config, self.arch, self.tokenizer, self.dtype, self.device, self.max_model_len + 1, tp is not None
        )
        # --deterministic: the fastest batch-invariant numerics this device has (every rank of a group the same)
        agree = self.tp.min_int if self.tp is not None else None
        self.numerics = pick_numerics(config.is_deterministic, self.model.row_functions, self.dtype, self.device, agree)
        # a tensor-parallel rank's heads
        self.layout = layout_of(self.model.arch, config.block_size, self.dtype, draft=draft_layout)
        self.memory = plan_memory(
            config, self.model.arch, self.layout, self.model, self.numerics, self.device, self.max_model_len
        )
        if tp is not None:  # rank 0's block ids must exist on every rank
            self.memory = dataclasses.replace(
                self.memory, num_blocks=tp.min_int(self.memory.num_blocks), num_swa_slots=tp.min_int(self.memory.num_swa_slots)
            )
        self.kv = KVCache(self.layout, self.memory.num_blocks, self.memory.num_swa_slots, self.device)
        self.blocks = BlockPool(self.memory.num_blocks)
        self.slots = BlockPool(self.memory.num_swa_slots)
        # CE: finished P/D sequences' pages stay in self.blocks as evictable cache (only pages: the SWA
        # state always travels, so a model without full-attention layers retains nothing)
        keeps_pages = config.uses_decode_cache and self.arch.has_full
        self.decode_cache = DecodeCache(self.blocks, config.block_size) if keeps_pages else None
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.block_size, self.arch.has_full, self.arch.has_sliding)
        self.scheduler = Scheduler(sched, self.blocks, self.slots, on_admit=self._admit)
        self.prefix_cache = HostPrefixCache.sized(  # None: --hicache-gb 0
            config, self.arch, self.kv, tp.size if tp else 1, records=tp is not None and tp.is_leader
        )
        self.kv_events = kv_events.for_engine(config.records_kv_events, self.prefix_cache, self.decode_cache)
        rows_per_seq = 1 + speculative.max_drafts(config)  # a sequence verifies its drafts as rows of their own
        self.runner = ModelRunner(
            self.model, self.kv, self.numerics, config.forward, max_decode_rows=config.max_num_seqs * rows_per_seq,
            max_model_len=self.max_model_len, tp=tp, verify_width=rows_per_seq,
        )  # fmt: skip
        # --ep N: this rank's expert-parallel group (every step then enters the MoE layers' exchanges); with
        # --tp, the world's (engine/parallel/world.py): every process of every tensor-parallel group
        self.ep = expert_parallel.current()
        if self.ep is not None and not self.arch.sparse_layers:
            raise InvalidRequestError(f"--ep {self.ep.size} needs a mixture-of-experts model; {config.model} is dense")
        self.num_ep_steps = 0
        self.eplb = RebalanceStats()
        self.graph_stats: GraphCaptureStats | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.ep is None and tp is None:
            # (no collectives in graphs)
            verify_rows = config.max_num_seqs * rows_per_seq if rows_per_seq > 1 else 0
            self.graph_stats = self.runner.capture_graphs(
                graph_batch_sizes(config.max_num_seqs), graph_batch_sizes(verify_rows) if verify_rows else None
            )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # final outputs of aborted requests, sent by the next step
        # --speculative-config: drafts verified in each decode step (engine/speculative/)
        self.speculator = speculative.build_speculator(
            config, tp is not None or self.ep is not None, self.model, self.draft_model, self.kv, self.numerics,
            self.scheduler, self.max_model_len, self.dtype, self.arch.vocab_size,
        )  # fmt: skip
        self.runner.keep_hidden = self.speculator is not None and self.speculator.mtp is not None
        # --launch-ahead: the next decode batch queued before its step; never in a group (its ranks step in
        # lockstep), nor with speculation (a step's drafts come from the tokens the step before drew)
        self.ahead = LaunchAhead(
            self.scheduler, self.runner, config.launch_ahead and self.ep is None and self.speculator is None
        )
        self._admit_errors: dict[str, Exception] = {}  # request id -> its failed prefix restore (step() ends it)
        self.handoffs = HandoffLedger(self.scheduler, config.max_num_seqs, decode_cache=self.decode_cache)  # P/D states
        # --tp N: a handoff carries every KV head of the model, re-sharded by each group's rank 0
        # latent pages (MLA) hold one latent per token, the same on every rank: one replicated "head"
        handoff_heads = 1 if self.arch.is_mla else self.arch.num_kv_heads
        self.kv_shards = KVShards(tp, self.kv, handoff_heads) if tp is not None else None
        self.handoff_io = HandoffIO(
            self.handoffs, self.scheduler, self.kv, self.grammars, retains_at_end=self.decode_cache is not None, shards=self.kv_shards
        )
        # the P/D facade: export and import of a sequence, its streamed pages, where an import lands in place
        self.pd = HandoffFacade(self.handoffs, self.handoff_io, self.validate, self._imported, self._handed_off)
        self.export_sequence, self.export_pages = self.pd.export_sequence, self.pd.export_pages
        self.in_place_target, self.import_sequence = self.pd.in_place_target, self.pd.import_sequence
        self.finish_handoff = self.pd.finish_handoff
        # the layout a P/D handoff carries (the model's, whatever --tp; self.layout is this rank's share)
        self.handoff_layout = self.handoff_io.layout
        if not config.is_deterministic:
            preload_sdpa(config.forward, self.device)
        self._rng = random.Random(config.seed)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ---- requests -----------------------------------------------------------------------------

    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for a request that can never be served."""
        check_request(prompt_token_ids, params, self.arch.vocab_size, self.max_model_len)
        if params.structured is not None:
            self.grammars.check(params.structured)
        total = len(prompt_token_ids) + params.max_tokens
        if self.scheduler.blocks_for(total) > self.blocks.num_blocks:
            raise InvalidRequestError(
                f"{total} tokens need more KV memory than this engine has ({self.blocks.num_blocks} pages of "
                f"{self.layout.block_size} tokens)",
                "max_tokens",
            )
        if request_id in self._detok:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        use_prefix_cache: bool = True,
        prefill_only: bool = False,
        seed: int | None = None,
    ) -> None:
        """Queues a request. prefill_only (PE side): after the first token the sequence parks with
        its memory for export_sequence() instead of decoding; seed overrides the drawn one."""
        self.validate(request_id, prompt_token_ids, params)
        check_seed(seed)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, time.monotonic())
        seq.use_prefix_cache = use_prefix_cache
        seq.is_prefill_only = prefill_only
        # a CE's local prefill (take_over) is P/D traffic too: its next turn may be handed over here
        seq.is_retained_at_end = self.decode_cache is not None and self.handoffs.phase(request_id) is Phase.LOCAL
        if params.structured is not None:
            seq.matcher = self.grammars.matcher(params.structured, [])
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = PromptLogprobsCollector(len(prompt_token_ids), params.prompt_logprobs)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Ends a request in any phase (queued, prefilling, decoding; any P/D phase) and frees its
        memory; a known sequence gets a final output with finish_reason "abort"."""
        seq = self.handoffs.abort(request_id)
        if seq is None:
            seq = self.scheduler.find(request_id)
            if seq is None:
                return
            self.scheduler.finish(seq, "abort")
        self._pending.append(self._output(seq, is_final=True))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self.ahead.launched is not None

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch: schedule, run the model, sample, detokenize. An exception in any phase ends the
        request(s) it came from with finish_reason "error" (memory freed) and the engine serves the
        others: one sequence when it can be told apart (its prefix restore or store, its sampling,
        its detokenizing), the whole batch when not (the batched model run), every queued request
        when the scheduler itself fails. Fatal errors (engine/faults.py: out of device memory, CUDA)
        propagate.

        In an expert-parallel group every call runs exactly one forward, an empty one when nothing was
        scheduled (the peers' MoE layers wait for this rank's rows), and a failed forward is fatal
        (its peers are left mid-exchange: the group restarts). Every eplb_interval calls, the group
        rebalances its experts (engine/layers/eplb.py). Under --tp (engine/parallel/world.py) the group's other processes
        are told to do the same (PLAN_EXCHANGE, PLAN_REBALANCE), as they are told each forward."""
        if self.ep is None:
            return self._step()
        num_forwards = self.runner.num_forwards
        outputs = self._step()
        if self.runner.num_forwards == num_forwards:
            if self.tp is not None:
                self.tp.send_plan(PLAN_EXCHANGE)
            self.model.idle_exchange(self.numerics)
        self.num_ep_steps += 1
        if self.config.eplb_interval and self.num_ep_steps % self.config.eplb_interval == 0:
            if self.tp is not None:
                self.tp.send_plan(PLAN_REBALANCE)
            self._rebalance_experts()
        return outputs

    def _rebalance_experts(self) -> None:
        assert self.ep is not None
        rebalance_model(self.model.sparse_layers(), self.ep, self.eplb)

    def _step(self) -> list[RequestOutput]:
        """Schedule and run a batch (or take the one launched ahead by the last step), sample it; then,
        with launch_ahead, launch the next batch before this step's outputs are built and returned,
        so the device runs it while the host builds them and the caller handles them
        (engine/execution/launch_ahead.py)."""
        outputs, self._pending = self._pending, []
        launched = self.ahead.take()
        if launched is None:
            launched = self._launch(outputs)
            if launched is None:
                return outputs
        if self.ahead.feeds(launched):
            try:
                tokens = self.ahead.feed(launched)  # launches the next batch itself if it can
            except Exception as e:  # the batch's tokens are lost: its sequences fail, the rest goes on
                raise_if_fatal(e)
                outputs += [self._fail(seq, e, "taking its token on the device") for seq in launched.seqs]
                return outputs
            emit = self._append_tokens(launched.seqs, [(token, None) for token in tokens], outputs)
        else:
            emit = self._complete(launched, outputs)
        if self.ahead.launched is None and self.ahead.launches():
            self.ahead.hold(self._launch(outputs))
        for seq in emit:
            if seq.finish_reason == "error":  # its next batch, launched ahead, failed: its error is out
                continue
            try:
                outputs.append(self._output(seq, is_final=seq.status is SeqStatus.FINISHED))
            except Exception as e:
                raise_if_fatal(e)
                outputs.append(self._fail(seq, e, "sampling or detokenizing"))
        return outputs

    def _launch(self, outputs: list[RequestOutput]) -> LaunchedBatch | None:
        """Schedules a batch and queues its forward; None if there is nothing to run. Failures end
        their requests into outputs."""
        try:
            batch = self.scheduler.schedule()
        except Exception as e:
            raise_if_fatal(e)
            doomed = [*self.scheduler.running, *self.scheduler.waiting]
            outputs += [self._fail(seq, e, "scheduling") for seq in doomed]
            return None
        seqs, num_new = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            admit_error = self._admit_errors.pop(seq.request_id, None)
            if admit_error is None:
                seqs.append(seq)
                num_new.append(n)
            else:
                outputs.append(self._fail(seq, admit_error, "restoring its cached prefix"))
        if not seqs:
            return None
        for seq in seqs:
            if seq.num_computed == seq.num_cached_prompt and not seq.output_token_ids:  # its first chunk
                self.num_prompt_tokens_total += seq.num_prompt_tokens  # cache hits included, as in vLLM
        if self.tp is not None and self.prefix_cache is not None:  # the group's pools copy what rank 0's did
            copies = self.prefix_cache.take_copies()
            if copies:
                self.tp.send_plan(PLAN_COPY, copies)
        if self.speculator is not None:
            num_new = self.speculator.draft(seqs, num_new, self.config.max_num_batched_tokens - sum(num_new))
        try:
            sampled, logits = self.runner.run(seqs, num_new)
        except Exception as e:
            raise_if_fatal(e)  # NOTE: the culprit is unknown in a batched forward: the batch fails
            if self.speculator is not None:
                self.speculator.drop(seqs)
            if self.ep is not None or self.tp is not None:  # the peers are left mid-collective
                raise
            outputs += [self._fail(seq, e, "running the model") for seq in seqs]
            return None
        return LaunchedBatch(seqs, num_new, sampled, logits)

    def _complete(self, launched: LaunchedBatch, outputs: list[RequestOutput]) -> list[Sequence]:
        """A launched batch's tokens counted, prefixes stored, rows sampled and appended (finishing
        the sequences they end); returns the sequences that got a token, whose outputs are due.
        A sequence that left the batch after its launch (aborted) is skipped."""
        seqs = launched.seqs
        starts = [seq.num_computed for seq in seqs]  # a drafter (MTP, draft model) catches up from here
        for seq, n in zip(seqs, launched.num_new):
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed += n - len(seq.draft_token_ids)  # drafts count once accepted (self.speculator)
        if self.speculator is not None:  # NOTE: before the store: a draft model's KV goes into the same pages
            self.speculator.after_forward(seqs, starts, launched.num_new)
        for seq in seqs:
            if seq.status is SeqStatus.RUNNING and seq.cache_store_upto and seq.num_computed == seq.cache_store_upto:
                try:
                    assert self.prefix_cache is not None  # only its restore sets cache_store_upto
                    self.prefix_cache.store(seq, self.kv)
                except Exception as e:
                    raise_if_fatal(e)
                    outputs.append(self._fail(seq, e, "storing its prefix"))
        logits, sampled = launched.logits, launched.sampled
        emit: list[Sequence] = []
        if self.speculator is not None:
            if logits is not None:
                num_rows = [1 + len(seqs[i].draft_token_ids) for i in sampled]
                emit = self.speculator.complete(seqs, sampled, num_rows, partial(self._draw_rows, logits, outputs))
            hidden, self.runner.last_hidden = self.runner.last_hidden, None  # an MTP drafter reads them
            self.speculator.after_step(seqs, starts, hidden, self.runner.last_hidden_rows)
            return emit
        if logits is None:
            return []
        rows = [i for i, _ in enumerate(sampled) if seqs[sampled[i]].status is SeqStatus.RUNNING]
        to_sample = [seqs[sampled[i]] for i in rows]
        drawn = self.drawer.draw(logits if len(rows) == len(sampled) else logits[rows], to_sample)
        return self._append_tokens(to_sample, drawn, outputs)

    def _draw_rows(self, logits: torch.Tensor, outputs: list[RequestOutput], seqs: list[Sequence], rows: list[int]) -> list[Sequence]:
        return self._append_tokens(seqs, self.drawer.draw(logits[rows], seqs), outputs)  # a speculator's rows

    def _append_tokens(
        self,
        seqs: list[Sequence],
        drawn: list[tuple[int, TokenLogprob | None] | Exception],
        outputs: list[RequestOutput],
    ) -> list[Sequence]:
        """Each sequence's drawn token appended (or its error ending it, into outputs); returns the
        sequences that got one, whose outputs are due."""
        emit = []
        for seq, got in zip(seqs, drawn):
            try:
                if isinstance(got, Exception):
                    raise got
                self._append_token(seq, *got)
                emit.append(seq)
            except Exception as e:
                raise_if_fatal(e)
                outputs.append(self._fail(seq, e, "sampling or detokenizing"))
        return emit

    def _admit(self, seq: Sequence) -> None:
        """The scheduler's on_admit: a failed prefix restore is remembered and fails seq in step()."""
        try:
            if seq.is_retained_at_end and self.decode_cache is not None:
                self.decode_cache.adopt(seq)  # a CE's local prefill starts after the pages it holds
            if self.prefix_cache is not None:
                self.prefix_cache.restore(seq, self.kv)
        except Exception as e:
            raise_if_fatal(e)
            self._admit_errors[seq.request_id] = e

    def _fail(self, seq: Sequence, error: Exception, phase: str) -> RequestOutput:
        """Ends seq, in whatever state the failure left it (running, parked for export, imported,
        already finished), with finish_reason "error"; frees its memory and its P/D entry."""
        rid = seq.request_id
        if isinstance(error, InvalidRequestError):  # the request's own fault: no traceback
            log.warning("request %r failed while %s: %s", rid, phase, error)
        else:
            log.error("request %r failed while %s; the engine goes on", rid, phase, exc_info=error)
        self.handoffs.abort(rid)  # parked/exported: freed here; imported/local: its commit ends
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        self._detok.pop(rid, None)
        return RequestOutput(
            rid,
            [],
            is_finished=True,
            finish_reason="error",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt,
            num_output_tokens=len(seq.output_token_ids),
            error=str(error) if isinstance(error, InvalidRequestError) else FAILED.format(phase=phase),
            is_request_fault=isinstance(error, InvalidRequestError),
        )

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        seq.output_token_ids.append(token)
        if lp is not None:
            seq.output_logprobs.append(lp)
        self.num_generation_tokens_total += 1
        if seq.matcher is not None:
            seq.matcher.accept(token)
        detok = self._detok[seq.request_id]
        detok.add(token)
        reason = self._finish_reason(seq, token, detok)
        if reason is not None:
            self._finish(seq, reason)
        elif seq.is_prefill_only:
            self.handoffs.park(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A sequence ends normally (stop, length): a CE's keeps its full computed pages as cache. An
        abort or a failure retains nothing (its KV may be incomplete)."""
        if seq.is_retained_at_end and self.decode_cache is not None:
            self.decode_cache.retain(seq.token_ids(0, seq.num_computed), seq.block_ids)
        self.scheduler.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if detok.stopped_by is not None:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_finished:
            return "stop"  # the grammar is complete and nothing may follow
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, is_final: bool) -> RequestOutput:
        detok = self._detok[seq.request_id]
        new = seq.output_token_ids[seq.num_emitted_tokens :]
        new_lps = seq.output_logprobs[seq.num_emitted_tokens :] if seq.params.logprobs is not None else []
        # the prompt's logprobs go with the first token (vLLM's: with the first output after the prefill)
        is_first = seq.num_emitted_tokens == 0 and bool(new)
        prompt_lps = seq.prompt_logprobs.result() if is_first and seq.prompt_logprobs is not None else None
        seq.num_emitted_tokens = len(seq.output_token_ids)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            text_delta=detok.release(is_final),
            logprobs=list(new_lps),
            is_finished=is_final,
            finish_reason=seq.finish_reason if is_final else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt,
            num_output_tokens=len(seq.output_token_ids),
            is_handoff_ready=seq.status is SeqStatus.PARKED,
            prompt_logprobs=prompt_lps,
        )
        if is_final:
            del self._detok[seq.request_id]
            self.handoffs.end(seq.request_id)
        return out

    # ---- a tensor-parallel group ---------------------------------------------------------------

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: runs the forwards rank 0 broadcasts, until it closes."""
        if self.tp is None or self.tp.is_leader:
            raise RuntimeError("follow() is for the ranks of a tensor-parallel group other than 0")
        while True:
            kind, plan = self.tp.receive_plan()
            if kind == PLAN_STOP:
                return
            if kind == PLAN_STEP:
                self.runner.follow(StepPlan.from_wire(plan))
            elif kind == PLAN_COPY:
                assert self.prefix_cache is not None  # the same config as rank 0's
                self.prefix_cache.replay([(c[0], c[1], c[2], c[3]) for c in plan], self.kv)
            elif kind in (PLAN_EXPORT, PLAN_IMPORT):
                assert self.kv_shards is not None
                self.kv_shards.follow(kind, plan)
            elif kind == PLAN_EXCHANGE:
                self.model.idle_exchange(self.numerics)
            elif kind == PLAN_REBALANCE:
                self._rebalance_experts()
            elif kind == PLAN_COUNTERS:
                self._group_moe_counters()

    def heartbeat(self) -> None:
        """Rank 0 of a tensor-parallel group, idle: tells the others it lives (an idle follower's wait for a
        plan fails after rank_group.TIMEOUT_S; the server's rank beats every second)."""
        if self.tp is not None and self.tp.is_leader:
            self.tp.send_plan(PLAN_IDLE)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel group: the other ranks' follow() returns."""
        if self.tp is not None and self.tp.is_leader:
            self.tp.send_plan(PLAN_STOP)

    # ---- export / import: the P/D facade (engine/handoff/facade.py) --------------------------------

    def _handed_off(self, request_id: str) -> None:
        del self._detok[request_id]

    def _imported(self, seq: Sequence, exp: SequenceExport) -> None:
        """An imported sequence's detokenizer fed its tokens; one whose first token ends it is reported."""
        detok = IncrementalDetokenizer(self.tokenizer, exp.params.stop)
        self._detok[seq.request_id] = detok
        for t in exp.output_token_ids:
            detok.add(t)
        reason = self._finish_reason(seq, exp.output_token_ids[-1], detok) if exp.output_token_ids else None
        if reason is not None:  # e.g. the first token was EOS: report it and end here
            self._finish(seq, reason)
            self._pending.append(self._output(seq, is_final=True))

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        if self.tp is not None and self.ep is not None and self.tp.is_leader:
            return engine_stats(self, self._group_moe_counters())
        return engine_stats(self)

    def _group_moe_counters(self) -> MoeCounters | None:
        assert self.tp is not None
        if self.tp.is_leader:
            self.tp.send_plan(PLAN_COUNTERS)
        return group_moe_counters(self.tp, self.model, self.device, self.arch.moe.num_experts if self.arch.moe else 0)

    def check_idle(self) -> None:
        """With no request in flight, every page and slot is free (or evictable cache); raises on a leak."""
        if self.scheduler.has_unfinished() or self.ahead.launched is not None:
            raise AssertionError("requests still in flight (running, waiting or launched)")
        self.handoffs.check_idle()
        self.blocks.check_idle()
        self.slots.check_idle()
        if self.prefix_cache is not None:
            self.prefix_cache.index.check_idle()
        if self.decode_cache is not None:
            self.decode_cache.check_idle()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Runs prompts to completion (tests, benchmarks); returns the finished sequences in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._rng.getrandbits(48):012x}" for _ in prompts]
        seqs: dict[str, Sequence] = {}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            found = self.scheduler.find(rid)
            assert found is not None
            seqs[rid] = found
        while self.has_unfinished():
            self.step()
        return [seqs[rid] for rid in ids]

