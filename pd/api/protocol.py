"""OpenAI request bodies, checked and turned into typed requests. Every refusal is a 400 naming the field.

Unknown fields are ignored (clients send many); known fields with a bad type or value are refused, and so
are features the engine does not have when asked for with a non-default value, rather than silently
ignored.

Structured outputs come as OpenAI's `response_format` (json_object, json_schema) or vLLM's
`structured_outputs` extension ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}; its
older spelling `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` too); one of them per
request. The engine compiles the constraint: one it cannot compile is a 400 from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from engine.request import (
    MAX_LOGIT_BIAS,
    MAX_SEED,
    MAX_STRUCTURED_SPEC_CHARS,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutput,
)
from pd.chat.tool_choice import forced_schema
from pd.errors import bad_request

MAX_N = 16
MAX_BEAM_WIDTH = MAX_TOP_LOGPROBS // 2  # each beam step asks for 2 x width logprobs (vLLM's, under its 20)
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
MAX_SUBREQUESTS = 256  # prompts x n in one request
MAX_TOKEN_ID = 2**31 - 1  # token ids are 32-bit (the handoff packs them as int32)
MAX_DEPTH = 32  # JSON nesting in a body, tool schemas and tool-call arguments included
MIN_SEED = -(2**63)  # vLLM's seed range, torch.long's; the engine's seed is seed mod 2^63 (MAX_SEED + 1)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the openai client's
# The chat template renderer's own arguments (transformers' apply_chat_template and the variables it
# sets): chat_template_kwargs may not name them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "conversations", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
        "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs", "self",
    }
)  # fmt: skip
_UNSET = object()
# vLLM's request fields for features this server does not have, each with the values that ask for nothing
# (vLLM's defaults; null always does): any other value is a 400 naming the field, never ignored.
UNSUPPORTED_VLLM_FIELDS: dict[str, tuple[Any, ...]] = {
    "include_stop_str_in_output": (False,),  # with use_beam_search: the EOS counted and shown (BeamFields)
    "early_stopping": (False,),  # vLLM's v1 beam search takes it and does nothing with it
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "priority": (0,),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "mm_processor_kwargs": ({},),
    "prompt_embeds": ([],),  # completions; [] is no embeddings, as in vLLM (beside a prompt)
    "documents": (),  # chat's
    "chat_template": (),  # chat's: this server renders with its own (--chat-template)
}


@dataclass(frozen=True)
class BeamFields:
    """vLLM's beam search (use_beam_search): `n` beams, ranked by cumulative logprob, the answers by
    cumulative logprob / length ** length_penalty (pd/frontend/beam_search.py)."""

    width: int
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a beam ended by EOS keeps the EOS as a token (not in its text)


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields chat and completions share, checked."""

    max_tokens: int | None  # None: whatever the context leaves
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    stream: bool
    include_usage: bool
    use_prefix_cache: bool
    # vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk, the choice's
    # tokens so far
    is_usage_continuous: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob plus the top N
    beam: BeamFields | None = None  # vLLM's use_beam_search: the n choices are beams

    def params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """Engine parameters of choice number `choice` (seeded choices get seed + choice, so n > 1 differs)."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            structured=self.structured,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[
        dict[str, Any], ...
    ]  # normalized: role, content (str | None), optional name/tool_calls/tool_call_id
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects: {"type": "function", "function": {...}}
    tool_choice: (
        str | dict[str, Any]
    )  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    logprobs: int | None  # None: off; N: chosen token plus top N
    sampling: SamplingFields
    # extra variables of the chat template: chat_template_kwargs, and reasoning_effort when given
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (--reasoning-parser)
    # vLLM's, passed to the template: the assistant header after the chat, or the last (assistant) message
    # left open so the answer continues it ("response prefill"); at most one of them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own (BOS) on top of what the template writes
    parallel_tool_calls: bool = True  # OpenAI's: false returns the answer's first tool call only
    # vLLM's echo: the answer's content starts with the last message's, when that message has the answer's
    # role (the assistant's; the last message's own without a generation prompt): response prefill returned whole
    echo: bool = False

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def echoed(self) -> str:
        """What `echo` puts before the answer's content (vLLM's): the last message's content when its role
        is the answer's ("assistant" after a generation prompt, else the last message's own), or ""."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last["role"]
        return (last.get("content") or "") if self.echo and last["role"] == role else ""


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    echo: bool
    logprobs: int | None
    sampling: SamplingFields
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (BOS) before a text prompt


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict[str, Any], key: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(key, _UNSET)
    if v is _UNSET or v is None:
        return default
    rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 2**63:
        # an integer literal past 64 bits, which the JSON parser gives as a float: outside any range here
        limits = rng if hi is not None else f"{rng} and below 2^63"
        raise bad_request(f"'{key}' must be an integer {limits}, got {v:.6g}", key)
    if not _is_int(v):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{key}' must be an integer {rng}, got {v}", key)
    return v


def _number(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = body.get(key, _UNSET)
    if v is _UNSET or v is None:
        return default
    if not _is_number(v):
        raise bad_request(f"'{key}' must be a number, got {type(v).__name__}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, _UNSET)
    if v is _UNSET or v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    """One structured_outputs entry (vLLM's names: json, regex, choice, grammar, json_object)."""
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as an object or as its JSON text
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise bad_request(f"'{param}' must be a JSON schema: {e}", param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
        check_depth(value, param)
        return _structured("json_schema", orjson.dumps(value).decode(), param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"'{param}' must be true", param)
        return StructuredOutput("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be a non-empty array of non-empty strings", param)
        return _structured("choice", orjson.dumps(value).decode(), param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param)
    return _structured(kind, value, param)


def _structured(kind: Any, spec: str, param: str) -> StructuredOutput:
    if len(spec) > MAX_STRUCTURED_SPEC_CHARS:
        raise bad_request(f"'{param}' is longer than {MAX_STRUCTURED_SPEC_CHARS} characters", param)
    return StructuredOutput(kind, spec)


def _response_format(body: dict[str, Any]) -> StructuredOutput | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'schema' object", "response_format.json_schema"
            )
        if not isinstance(js.get("name", ""), str):
            raise bad_request("'response_format.json_schema.name' must be a string", "response_format.json_schema.name")
        return _spec("json", js["schema"], "response_format.json_schema.schema")
    raise bad_request(
        f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)", "response_format.type"
    )


def _structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's one constraint, from response_format or structured_outputs (or guided_*)."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = _response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise bad_request(
                f"'structured_outputs' does not take {unknown} (json, regex, choice, grammar, json_object)",
                "structured_outputs",
            )
        for k, v in so.items():
            if v is not None and v is not False:
                found.append((f"structured_outputs.{k}", _spec(k, v, f"structured_outputs.{k}")))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, _spec(kind, body[key], key)))
    if len(found) > 1:
        raise bad_request(f"give one structured output, not {[k for k, _ in found]}", found[1][0])
    return found[0][1] if found else None


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings; integers too) to a bias in [-100, 100]."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in lb.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or token > MAX_TOKEN_ID:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if not _is_number(bias) or abs(bias) > 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        out.append((token, float(bias)))
    if len({t for t, _ in out}) != len(out):
        raise bad_request("'logit_bias' names a token twice", "logit_bias")
    return tuple(sorted(out))


def _sampling(body: dict[str, Any], max_tokens_keys: tuple[str, ...], min_max_tokens: int = 1) -> SamplingFields:
    max_tokens = None
    for key in max_tokens_keys:  # later keys win: max_completion_tokens over the deprecated max_tokens
        max_tokens = _int(body, key, max_tokens, lo=min_max_tokens)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
        if len(stops) > MAX_STOP:
            raise bad_request(f"'stop' takes at most {MAX_STOP} strings", "stop")
    else:
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in stop_ids):
        raise bad_request(
            "'stop_token_ids' must be an array of token ids (integers >= 0; the model's vocabulary "
            "is checked too)",
            "stop_token_ids",
        )
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = is_usage_continuous = False
    if so is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool(so, "include_usage", False)
        # vLLM's: usage in every chunk, when usage is asked for at all (alone it asks for nothing, as there)
        is_usage_continuous = _bool(so, "continuous_usage_stats", False) and include_usage
        for key, value in so.items():  # OpenAI's include_obfuscation, ...
            if key not in ("include_usage", "continuous_usage_stats") and value not in (None, False):
                raise bad_request(f"'stream_options.{key}' is not supported", f"stream_options.{key}")
    top_k = _int(body, "top_k", 0, lo=-1)
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k < 0 else top_k,
        seed=_int(body, "seed", None, lo=MIN_SEED, hi=MAX_SEED),
        stop=stops,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        n=_int(body, "n", 1, lo=1, hi=MAX_N),
        stream=stream,
        include_usage=include_usage,
        is_usage_continuous=is_usage_continuous,
        use_prefix_cache=_bool(body, "prefix_cache", True),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 2.0),
        logit_bias=_logit_bias(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=_int(body, "min_tokens", 0, lo=0),
        structured=_structured_output(body),
        prompt_logprobs=_prompt_logprobs(body, stream),
    )


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's prompt_logprobs: N in [0, MAX_TOP_LOGPROBS], whole answers only (vLLM refuses it streamed;
    0 too here, which vLLM takes and returns nothing for)."""
    v = body.get("prompt_logprobs")
    if v is None:
        return None
    if _is_int(v) and v == -1:  # vLLM's "the whole vocabulary": past its --max-logprobs (20), a 400 there too
        raise bad_request(
            f"'prompt_logprobs' -1 asks for the whole vocabulary: this server gives at most {MAX_TOP_LOGPROBS}",
            "prompt_logprobs",
        )
    n = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    return int(n)


# The sampling fields beam search has no use for (it ranks by the model's own logprobs, as vLLM's does),
# with the values that ask for nothing: any other is a 400 naming the field.
_NOT_FOR_BEAMS: dict[str, Any] = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": (), "min_tokens": 0, "stop": (), "stop_token_ids": (),
    "prompt_logprobs": None, "structured": None,
}  # fmt: skip
_STRUCTURED_KEYS = ("response_format", "structured_outputs", *_GUIDED, "tool_choice")


def _beam(body: dict[str, Any], sampling: SamplingFields, can_stream: bool) -> SamplingFields:
    """vLLM's use_beam_search (n beams, length_penalty, include_stop_str_in_output), checked; the sampling
    fields that do not apply to it are refused, naming them. can_stream: chat's answer may come as a stream
    (of the finished beams, as vLLM's); completions refuse it, as vLLM does."""
    length_penalty = _number(body, "length_penalty", 1.0, -10.0, 10.0)
    if not _bool(body, "use_beam_search", False):
        if length_penalty != 1.0:
            raise bad_request("'length_penalty' applies to beam search: send 'use_beam_search': true", "length_penalty")
        return sampling
    if sampling.n > MAX_BEAM_WIDTH:
        raise bad_request(f"beam search takes 'n' (the beam width) up to {MAX_BEAM_WIDTH}, got {sampling.n}", "n")
    if sampling.stream and not can_stream:
        raise bad_request("'stream' is not supported with beam search (vLLM's: the beams end together)", "stream")
    for name, neutral in _NOT_FOR_BEAMS.items():
        if getattr(sampling, name) != neutral:
            param = name
            if name == "structured":
                param = next((k for k in _STRUCTURED_KEYS if body.get(k) is not None), "structured_outputs")
            raise bad_request(f"'{param}' does not apply to beam search: leave it out", param)
    include_stop = _bool(body, "include_stop_str_in_output", False)
    return replace(sampling, beam=BeamFields(sampling.n, length_penalty, include_stop))


def _model(body: dict[str, Any]) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad_request("'model' must be a string", "model")
    return m


def _content(v: Any, param: str, nullable: bool) -> str | None:
    if v is None:
        if nullable:
            return None
        raise bad_request(f"'{param}' is required", param)
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise bad_request(
                    f"'{param}[{j}]' is a {kind!r} part: this server serves text-only models, and takes "
                    'text parts ({"type": "text", "text": ...}) only',
                    param,
                    code="unsupported_content",
                )
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f'\'{param}[{j}]\' must be a text part {{"type": "text", "text": ...}}', param
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"'{param}' must be a string or an array of text parts", param)


def _tool_calls(v: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise bad_request(f"'{param}' must be an array", param)
    calls = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f'\'{param}[{j}]\' must be {{"type": "function", "function": {{"name", "arguments"}}}}', param
            )
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"'{param}[{j}].function.arguments' must be a JSON string", param)
        if isinstance(args, str) and args.count("[") + args.count("{") > MAX_DEPTH:
            try:  # the template may parse and walk them
                check_depth(orjson.loads(args), f"{param}[{j}].function.arguments")
            except orjson.JSONDecodeError:
                pass  # not JSON: the template gets the string as it is
        calls.append(
            {
                "id": str(c.get("id", f"call_{j}")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


def _messages(v: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{p}' must be an object", p)
        role = m.get("role")
        if not isinstance(role, str) or not role:  # any role reaches the template, as in vLLM: it decides
            raise bad_request(f"'{p}.role' must be a non-empty string, got {role!r}", f"{p}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise bad_request(f"'{p}.tool_calls' is taken on assistant messages only", f"{p}.tool_calls")
            msg["tool_calls"] = _tool_calls(tool_calls, f"{p}.tool_calls")
        msg["content"] = _content(m.get("content"), f"{p}.content", nullable=role == "assistant")
        for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad_request(f"'{p}.{key}' must be a string", f"{p}.{key}")
        msg.update({key: m[key] for key in ("name", "tool_call_id") if m.get(key) is not None})
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        if reasoning:  # an earlier answer's thinking, under vLLM's two names: the template shows it or not
            if role != "assistant":
                raise bad_request(f"'{p}.reasoning' is taken on assistant messages only", f"{p}.reasoning")
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        out.append(msg)
    return tuple(out)


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str | dict[str, Any]]:
    tools = body.get("tools")
    checked: list[dict[str, Any]] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise bad_request(
                    f'\'tools[{i}]\' must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]"
                )
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request(
                    f"'tools[{i}].function.name' must be a non-empty string", f"tools[{i}].function.name"
                )
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad_request(
                    f"'tools[{i}].function.parameters' must be an object", f"tools[{i}].function.parameters"
                )
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise bad_request(
                    f"'tools[{i}].function.description' must be a string", f"tools[{i}].function.description"
                )
            checked.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return tuple(checked), "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or a function object", "tool_choice"
            )
        if choice != "none" and not checked:
            raise bad_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return tuple(checked), choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or a function object", "tool_choice"
        )
    if fn["name"] not in {t["function"]["name"] for t in checked}:
        raise bad_request(
            f"'tool_choice' names function '{fn['name']}', which is not in 'tools'", "tool_choice"
        )
    return tuple(checked), {"type": "function", "function": {"name": fn["name"]}}


def check_depth(value: Any, param: str | None = None, limit: int = MAX_DEPTH) -> None:
    """400 when arrays and objects nest deeper than `limit` (rendering recurses through them)."""
    level = [value]
    for _ in range(limit + 1):
        level = [
            item
            for v in level
            if isinstance(v, (dict, list))
            for item in (v.values() if isinstance(v, dict) else v)
            if isinstance(item, (dict, list))
        ]
        if not level:
            return
    raise bad_request(f"JSON nested deeper than {limit} levels", param, code="too_deep")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_depth(body)
    return body


def parse_object(body: Any) -> dict[str, Any]:
    """A request body that must be a JSON object (nesting checked)."""
    return _object(body)


def parse_model(body: dict[str, Any]) -> str | None:
    return _model(body)


def parse_token_ids(body: dict[str, Any], key: str, vocab_size: int) -> list[int]:
    """body[key]: a list of token ids in [0, vocab_size)."""
    ids = body.get(key)
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise bad_request(f"'{key}' must be an array of token ids in [0, {vocab_size})", key)
    return ids


def _refuse_media(body: dict[str, Any]) -> None:
    """Audio output and modalities other than text: this server serves text-only models."""
    if body.get("audio") is not None:
        raise bad_request("'audio' output is not supported: this server serves text-only models", "audio")
    modalities = body.get("modalities")
    if modalities is None:
        return
    if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
        raise bad_request("'modalities' must be an array of strings", "modalities")
    other = [m for m in modalities if m != "text"]
    if other:
        raise bad_request(f"'modalities' supports only \"text\", got {other}", "modalities")


def _refuse_unsupported(body: dict[str, Any], sampling: SamplingFields) -> None:
    """A 400 for the first UNSUPPORTED_VLLM_FIELDS entry set to anything but a value that asks for nothing
    (include_stop_str_in_output is taken with beam search)."""
    for key, neutral in UNSUPPORTED_VLLM_FIELDS.items():
        v = body.get(key)
        if key == "include_stop_str_in_output" and sampling.beam is not None:
            continue
        if v is None or any(type(v) is type(n) and v == n for n in neutral):
            continue
        send = f" or send {orjson.dumps(neutral[0]).decode()}" if neutral else ""
        raise bad_request(f"'{key}' is not supported by this server: leave it out{send}", key)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs (vLLM's), checked, with reasoning_effort (OpenAI's) added when given."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kw))
    if clash:
        raise bad_request(
            f"'chat_template_kwargs' may not set {clash}: the server sets them itself", "chat_template_kwargs"
        )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                "reasoning_effort",
            )
        kw = {**kw, "reasoning_effort": effort}
    return dict(kw)


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    model = _model(body)
    messages = _messages(body.get("messages"))
    sampling = _sampling(body, ("max_tokens", "max_completion_tokens"))
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not want_logprobs:  # 0 asks for nothing (vLLM's check)
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    tools, tool_choice = _tools(body)
    parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    sampling = _with_tool_constraint(sampling, tools, tool_choice, parallel_tool_calls)
    sampling = _beam(body, sampling, can_stream=True)
    _refuse_media(body)
    _refuse_unsupported(body, sampling)
    add_generation_prompt, continue_final_message = _generation_prompt(body, messages)
    return ChatRequest(
        model,
        messages,
        tools,
        tool_choice,
        (top or 0) if want_logprobs else None,
        sampling,
        _template_kwargs(body),
        _bool(body, "include_reasoning", True),
        add_generation_prompt,
        continue_final_message,
        _bool(body, "add_special_tokens", False),
        parallel_tool_calls,
        _bool(body, "echo", False),
    )


def _with_tool_constraint(
    sampling: SamplingFields, tools: tuple[dict[str, Any], ...], tool_choice: Any, parallel_tool_calls: bool
) -> SamplingFields:
    """A forced tool_choice constrains the output to its tools' schema (pd/chat/tool_choice.py), as vLLM
    does; a request that also gives its own structured output is refused (one constraint per answer)."""
    schema = forced_schema(tools, tool_choice, parallel_tool_calls)
    if schema is None:
        return sampling
    if sampling.structured is not None:
        raise bad_request(
            "a forced 'tool_choice' (\"required\" or a named function) constrains the answer to the tools' "
            "schema: it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    return replace(sampling, structured=_structured("json_schema", orjson.dumps(schema).decode(), "tools"))


def _generation_prompt(body: dict[str, Any], messages: tuple[dict[str, Any], ...]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message), vLLM's: both true is a 400; continuing asks for the
    last message to be the assistant's, and leaves out the generation prompt unless that is given too."""
    is_continued = _bool(body, "continue_final_message", False)
    add = _bool(body, "add_generation_prompt", not is_continued)
    if is_continued and add:
        raise bad_request(
            "cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
            "continue_final_message",
        )
    if is_continued and messages[-1]["role"] != "assistant":
        raise bad_request(
            "'continue_final_message' continues the last message, which must be from the assistant, "
            f"not {messages[-1]['role']!r}",
            "continue_final_message",
        )
    return add, is_continued


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    model = _model(body)
    prompt = body.get("prompt", _UNSET)
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [tuple(p) for p in prompt]
    else:
        raise bad_request("'prompt' must be a string, an array of token ids, or an array of either", "prompt")
    for (
        p
    ) in prompts:  # the vocabulary is the engine's check; this one keeps the tokenizer's decode (echo) safe
        if isinstance(p, tuple) and any(not 0 <= t <= MAX_TOKEN_ID for t in p):
            raise bad_request(f"'prompt' token ids must be in [0, {MAX_TOKEN_ID}]", "prompt")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = _bool(body, "echo", False)
    sampling = _sampling(body, ("max_tokens",), min_max_tokens=0)
    if sampling.max_tokens == 0 and not echo:
        raise bad_request(
            "'max_tokens' must be an integer >= 1 (0 only with 'echo': the prompt alone, with its logprobs)",
            "max_tokens",
        )
    best_of = _int(body, "best_of", sampling.n, lo=1)
    if best_of != sampling.n:
        raise bad_request("'best_of' is not supported (only equal to 'n')", "best_of")
    if len(prompts) * sampling.n > MAX_SUBREQUESTS:
        raise bad_request(f"prompts x n must be at most {MAX_SUBREQUESTS}", "n")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if echo and logprobs is not None and sampling.prompt_logprobs is None:
        # vLLM's: the echoed prompt's logprobs are its prompt logprobs, with the top `logprobs`
        sampling = replace(sampling, prompt_logprobs=logprobs)
    sampling = _beam(body, sampling, can_stream=False)
    if sampling.beam is not None and echo:
        raise bad_request("'echo' is not supported with beam search", "echo")
    _refuse_unsupported(body, sampling)
    special = _bool(body, "add_special_tokens", True)
    return CompletionRequest(model, tuple(prompts), echo, logprobs, sampling, special)
