"""Handoff format units: checksum definition and sensitivity, header encode/decode and its refusals,
layout checks, the cluster token."""

from __future__ import annotations

import dataclasses
import random
import re
import struct

import msgpack
import pytest
import torch

from engine.codec import to_wire
from engine.handoff import KVLayout, PoolPages
from engine.request import PromptLogprobs, SamplingParams, TokenLogprob
from pdkernels import checksum as ck
from tests.transfer.support import LAYOUT_LATENT, LAYOUT_SWA, make_export
from transfer import auth
from transfer import checksum as tc
from transfer.errors import BAD_HEADER, LAYOUT, VERSION, HandoffError
from transfer.header import (
    HEADER_VERSION,
    IDS_INLINE_MAX,
    HandoffHeader,
    PackedIds,
    allocate_payload,
    check_layout,
    make_header,
    payload_segments,
    to_export,
)
from transfer.messages import Offer
from transfer.wire import pack, unpack

# ---- checksum ---------------------------------------------------------------------------------


def _reference(data: bytes, chunk_words: int) -> int:
    """The checksum definition in plain Python, for one segment."""
    nbytes = len(data)
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    total = 0
    for i, w in enumerate(words):
        c, j = divmod(i, chunk_words)
        m = ck.splitmix64(j ^ ck.SEED_M) | 1
        k = ck.splitmix64((c + ck.SEED_K) & ck.MASK64) | 1
        y = ((w ^ m) * ck.MUL) & ck.MASK64
        sy = y - (1 << 64) if y >> 63 else y
        x = y ^ ((sy >> 31) & ck.MASK64)
        total = (total + k * x) & ck.MASK64
    return ck.fold([(nbytes, total)])


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch):
    """Chunks of 64 words, so multi-chunk cases stay tiny."""
    monkeypatch.setattr(ck, "CHUNK_WORDS", 64)
    monkeypatch.setattr(ck, "CHUNK_BYTES", 512)
    monkeypatch.setattr(ck, "GPU_GROUP_CHUNKS", 3)
    ck.position_keys.cache_clear()
    yield 64
    ck.position_keys.cache_clear()


def test_splitmix_tensor_matches_python() -> None:
    xs = [0, 1, 2**62 + 12345, 2**63 - 1, 2**64 - 1]
    got = ck.splitmix64_tensor(torch.tensor([ck.signed64(x) for x in xs], dtype=torch.int64)).tolist()
    assert [g & ck.MASK64 for g in got] == [ck.splitmix64(x) for x in xs]


def test_checksum_matches_reference_definition(small_chunks: int) -> None:
    rng = random.Random(0)
    for nbytes in (8, 512, 64 * 8 * 3 + 40):  # one word, one chunk, three chunks + a partial one
        data = bytes(rng.getrandbits(8) for _ in range(nbytes))
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert tc.payload_checksum([t]) == _reference(data, small_chunks)


def test_numpy_and_torch_paths_agree(small_chunks: int) -> None:
    w = torch.randint(-(2**62), 2**62, (64 * 7 + 13,), dtype=torch.int64)
    for first in (0, 5):
        assert ck.numpy_segment_sum(w, first) == ck.torch_segment_sum(w, first)


def test_streaming_hasher_equals_one_pass(small_chunks: int) -> None:
    t = torch.randn(64 * 5 + 3, dtype=torch.float32)  # 1292 bytes: 2 chunks + a partial one
    b = t.view(torch.uint8)
    h = tc.SegmentHasher(b.numel())
    for off in range(0, b.numel(), 1024):
        h.update(b[off : off + 1024])
    assert ck.fold([h.result()]) == tc.payload_checksum([t])
    with pytest.raises(ValueError):
        tc.SegmentHasher(b.numel()).update(b[:100])  # a non-final piece inside a chunk


@pytest.mark.parametrize("page_words", [5, 64, 150, 1200])  # within a chunk, one, more; longer than the stage
def test_pages_in_a_pool_hash_as_the_tensor_they_stand_for(small_chunks: int, page_words: int) -> None:
    """PoolPages (a handoff received in place) hashed where they lie, scattered and out of order, give the
    checksum of their gathered copy; a slice too (a streamed part)."""
    pool = torch.randint(-(2**62), 2**62, (20, page_words), dtype=torch.int64)
    pages = PoolPages(pool, [7, 3, 4, 5, 19, 0, 1, 12, 13])
    assert [r.shape[0] for r in pages.runs()] == [1, 3, 1, 2, 2]
    assert tc.payload_checksum([pages]) == tc.payload_checksum([pages.gather()])
    assert tc.payload_checksum([pages[2:7]]) == tc.payload_checksum([pages.gather()[2:7]])
    assert pages.shape == (9, page_words) and pages.nbytes == 9 * page_words * 8


def test_nixl_pairs_a_payload_with_scattered_receive_buffers() -> None:
    """The sender cuts its contiguous segments where the receiver's buffers (runs of pool pages) end."""
    from transfer.nixl import _cut, _pair

    src, dst = _pair([(1000, 10, 0), (5000, 4, 0)], [(70, 3, 1), (80, 8, 1), (90, 3, 1)])
    assert src == [(1000, 3, 0), (1003, 7, 0), (5000, 1, 0), (5001, 3, 0)]
    assert dst == [(70, 3, 1), (80, 7, 1), (87, 1, 1), (90, 3, 1)]
    assert _cut([(70, 3, 1), (80, 8, 1), (90, 3, 1)], 2, 5) == [(72, 1, 1), (80, 4, 1)]
    with pytest.raises(HandoffError):
        _pair([(1000, 10, 0)], [(70, 11, 1)])  # receive buffers of another size
    with pytest.raises(HandoffError):
        _cut([(70, 3, 1)], 2, 5)  # past their end


def test_a_nixl_ready_bounds_the_write_to_a_pool_by_its_hold() -> None:
    """Pages in the CE's pool come with hold_s (how long the CE keeps them from reuse after a failure);
    the sender's write is given up within it. A malformed one is a protocol error."""
    from transfer.nixl import _read_ready

    ready = {"agent": b"md", "mem": "DRAM", "descs": [[70, 3, 0], [90, 5, 0]], "kept": True}
    assert _read_ready(ready)[2:] == ([(70, 3, 0), (90, 5, 0)], True, None)
    assert _read_ready({**ready, "hold_s": 12})[4] == 12.0
    for bad in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(HandoffError):
            _read_ready({**ready, "hold_s": bad})


def test_checksum_sees_corruption(small_chunks: int) -> None:
    base = torch.randn(64 * 4, dtype=torch.float32)
    ref = tc.payload_checksum([base])

    def changed(fn) -> bool:
        t = base.clone()
        fn(t.view(torch.int64))
        return tc.payload_checksum([t]) != ref

    assert changed(lambda w: w.__setitem__(3, w[3] ^ 1))  # one low bit
    assert changed(lambda w: w.__setitem__(slice(0, 2), w[[1, 0]]))  # two words swapped
    assert changed(
        lambda w: w.__setitem__(slice(0, 128), torch.cat([w[64:128], w[0:64]]))
    )  # two chunks swapped
    sign = -(2**63)
    assert changed(lambda w: w.__setitem__([5, 9], w[[5, 9]] ^ sign))  # the same high bit in two words
    assert changed(lambda w: w.__setitem__(slice(64, 128), 0))  # a chunk of zeros
    # segment boundaries count: the same bytes split differently are a different payload
    assert tc.payload_checksum([base[:64], base[64:]]) != ref


# ---- header -----------------------------------------------------------------------------------


def test_header_round_trip() -> None:
    exp = make_export()
    lps = [TokenLogprob(42, -0.25, ((42, -0.25), (9, -1.5)))]
    h = make_header(exp, LAYOUT_SWA, model="m1", output_logprobs=lps)
    assert (
        h.num_pages == 3
        and h.swa_fill == 24
        and h.payload_bytes == 3 * LAYOUT_SWA.page_bytes + LAYOUT_SWA.state_bytes
    )
    back = HandoffHeader.decode(h.encode())
    assert back == h
    assert back.params == exp.params and back.output_logprobs == tuple(lps)
    segs = allocate_payload(back)
    for src, dst in zip(payload_segments(exp, LAYOUT_SWA), segs):
        dst.copy_(src)
    assert tc.payload_checksum(segs) == back.checksum
    out = to_export(back, segs)
    assert out.prompt_token_ids == exp.prompt_token_ids and out.output_token_ids == [42] and out.seed == 1234
    assert torch.equal(out.pages, exp.pages) and out.state is not None and torch.equal(out.state, exp.state)


def _with_prompt_logprobs(num_top: int = 2):
    """make_export() asking for prompt logprobs (37 prompt tokens: 36 positions), with made-up values."""
    exp = make_export()
    n = len(exp.prompt_token_ids) - 1
    plp = PromptLogprobs(
        num_top,
        tuple(-0.5 - i / 7 for i in range(n)),
        tuple(1 + i % 3 for i in range(n)),
        tuple(range(n * num_top)),
        tuple(-0.25 - i / 3 for i in range(n * num_top)),
    )
    params = dataclasses.replace(exp.params, prompt_logprobs=num_top)
    return dataclasses.replace(exp, params=params, prompt_logprobs=plp)


def test_a_header_carries_the_prompt_logprobs() -> None:
    exp = _with_prompt_logprobs()
    h = make_header(exp, LAYOUT_SWA)
    back = HandoffHeader.decode(h.encode())
    assert back == h and back.prompt_logprobs == exp.prompt_logprobs  # the float values bit for bit
    assert to_export(back, allocate_payload(back)).prompt_logprobs == exp.prompt_logprobs
    assert HandoffHeader.decode(make_header(make_export(), LAYOUT_SWA).encode()).prompt_logprobs is None
    # they must be there exactly when the params ask for them, for every position of the prompt
    plp = exp.prompt_logprobs
    assert plp is not None
    to_wire_plp = dataclasses.asdict(plp)
    short = {**to_wire_plp, "logprobs": list(plp.logprobs[:-1]), "ranks": list(plp.ranks[:-1])}
    short["top_ids"], short["top_logprobs"] = list(plp.top_ids[:-2]), list(plp.top_logprobs[:-2])
    for changes in (
        dict(prompt_logprobs=None),
        dict(prompt_logprobs=short),
        dict(prompt_logprobs={**to_wire_plp, "num_top": 3}),
        dict(prompt_logprobs={**to_wire_plp, "ranks": [0] * plp.num_positions}),
        dict(prompt_logprobs={**to_wire_plp, "logprobs": ["x"] * plp.num_positions}),
    ):
        with pytest.raises(HandoffError) as e:
            HandoffHeader.decode(_tamper(h, **changes))
        assert e.value.code == BAD_HEADER, changes
    with pytest.raises(HandoffError):  # none asked for: none may come
        make_header(dataclasses.replace(exp, params=make_export().params), LAYOUT_SWA)


def test_a_header_whose_checksum_follows() -> None:
    exp = make_export()
    h = make_header(exp, LAYOUT_SWA, checksum_follows=True)
    assert h.checksum_follows and h.checksum == 0
    assert HandoffHeader.decode(h.encode()) == h
    assert not make_header(exp, LAYOUT_SWA).checksum_follows


def test_header_of_a_partial_handoff_carries_pages_from_first_page_on() -> None:
    """The CE's decode cache holds the first pages: the payload starts at first_page."""
    full = make_export()  # 37 prompt tokens: 3 pages of 16
    exp = dataclasses.replace(full, pages=full.pages[2:].clone(), first_page=2, pages_sum=None)
    h = make_header(exp, LAYOUT_SWA)
    assert h.first_page == 2 and h.num_pages == 1
    assert h.payload_bytes == LAYOUT_SWA.page_bytes + LAYOUT_SWA.state_bytes
    back = HandoffHeader.decode(h.encode())
    assert back == h
    segs = allocate_payload(back)
    for src, dst in zip(payload_segments(exp, LAYOUT_SWA), segs):
        dst.copy_(src)
    out = to_export(back, segs)
    assert out.first_page == 2 and torch.equal(out.pages, full.pages[2:])
    # no page at all (every computed token's page held) is a header too; past the last page is not
    none = dataclasses.replace(full, pages=full.pages[3:].clone(), first_page=3, pages_sum=None)
    assert make_header(none, LAYOUT_SWA).payload_bytes == LAYOUT_SWA.state_bytes
    for first_page in (4, -1):
        with pytest.raises(HandoffError) as e:
            HandoffHeader.decode(_tamper(h, first_page=first_page))
        assert e.value.code == BAD_HEADER
    with pytest.raises(HandoffError):  # the sizes must follow first_page
        HandoffHeader.decode(_tamper(h, first_page=1))


def test_header_without_swa_or_without_full_layers() -> None:
    full_only = dataclasses.replace(LAYOUT_SWA, num_swa_layers=0, window=0)
    h = make_header(make_export(full_only, num_prompt=16), full_only)
    assert h.num_pages == 1 and h.state_bytes == 0 and not h.has_state and h.swa_fill == 0
    swa_only = dataclasses.replace(LAYOUT_SWA, num_full_layers=0)
    h = make_header(make_export(swa_only, num_prompt=5), swa_only)
    assert h.num_pages == 0 and h.payload_bytes == swa_only.state_bytes and h.swa_fill == 5
    assert HandoffHeader.decode(h.encode()) == h


def test_long_prompt_ids_follow_the_header() -> None:
    """A prompt over IDS_INLINE_MAX tokens: the header announces its ids; they arrive separately."""
    n = IDS_INLINE_MAX + 5
    exp = dataclasses.replace(make_export(num_prompt=n), prompt_token_ids=[(7 * i) % 50000 for i in range(n)])
    h = make_header(exp, LAYOUT_SWA)
    assert not h.ids_inline and h.ids_bytes() == struct.pack(f"<{n}i", *exp.prompt_token_ids)
    d = msgpack.unpackb(h.encode(), raw=False)
    assert d["prompt_token_ids"] is None and d["num_prompt_tokens"] == n
    back = HandoffHeader.decode(h.encode())
    ids = back.prompt_token_ids
    assert isinstance(ids, PackedIds) and ids.pending and len(ids) == n
    with pytest.raises(HandoffError):
        to_export(back, allocate_payload(back))  # not before the ids arrive
    with pytest.raises(ValueError):
        ids.fill(h.ids_bytes()[:-4])  # one id short
    with pytest.raises(ValueError):
        ids.fill(b"\xff\xff\xff\xff" * n)  # negative
    ids.fill(h.ids_bytes())
    assert back == h and to_export(back, allocate_payload(back)).prompt_token_ids == exp.prompt_token_ids
    # a short prompt's ids must be in the header
    with pytest.raises(HandoffError) as e:
        HandoffHeader.decode(_tamper(make_header(make_export(), LAYOUT_SWA), prompt_token_ids=None))
    assert e.value.code == BAD_HEADER


def _tamper(h: HandoffHeader, **changes) -> bytes:
    d = msgpack.unpackb(h.encode(), raw=False)
    for k, v in changes.items():
        if v is KeyError:
            del d[k]
        else:
            d[k] = v
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "changes, code",
    [
        (dict(version=HEADER_VERSION + 1), VERSION),
        (dict(version=1), VERSION),  # token ids as a msgpack list
        (dict(block_size=32), BAD_HEADER),  # the sizes no longer add up
        (dict(payload_bytes=1), BAD_HEADER),
        (dict(num_computed=5), BAD_HEADER),
        (dict(checksum=KeyError), BAD_HEADER),
        (dict(checksum_follows=KeyError), BAD_HEADER),
        (dict(checksum_follows=1), BAD_HEADER),  # an int is not a bool here
        (dict(checksum_follows=True), BAD_HEADER),  # and a checksum given too
        (dict(extra_field=1), BAD_HEADER),
        (dict(prompt_token_ids=["a"]), BAD_HEADER),
        (dict(prompt_token_ids=[1, 2, 3]), BAD_HEADER),  # a list, not packed bytes
        (dict(prompt_token_ids=b"\x01\x00\x00"), BAD_HEADER),  # not whole int32s
        (dict(prompt_token_ids=b"\xff\xff\xff\xff" * 3), BAD_HEADER),  # -1
        (dict(num_pages="3"), BAD_HEADER),
        (dict(seed=True), BAD_HEADER),  # a bool is not an integer here
        (dict(num_prompt_tokens=KeyError), BAD_HEADER),
        (dict(window=KeyError), BAD_HEADER),
        (dict(dtype="int4"), BAD_HEADER),
        (dict(page_kind="mla"), BAD_HEADER),
        (dict(page_kind=KeyError), BAD_HEADER),
        (dict(page_kind=2), BAD_HEADER),
        (dict(page_kind="latent"), BAD_HEADER),  # a latent layout has one head and no sliding layers
        (dict(params={"max_tokens": 1, "top_n": 2}), BAD_HEADER),  # an unknown field
        (dict(params={"max_tokens": True}), BAD_HEADER),  # a bool for an int
        (dict(params={"stop": "x"}), BAD_HEADER),  # a string for a list
        (dict(params=[1]), BAD_HEADER),
        (dict(params={**dataclasses.asdict(SamplingParams()), "temperature": -1.0}), BAD_HEADER),
    ],
)
def test_header_decode_refuses(changes: dict, code: str) -> None:
    h = make_header(make_export(), LAYOUT_SWA)
    with pytest.raises(HandoffError) as e:
        HandoffHeader.decode(_tamper(h, **changes))
    assert e.value.code == code


def test_header_params_decode_through_the_codec() -> None:
    """The header's sampling params are the codec's: defaults for missing fields, the path of a bad one."""
    h = make_header(make_export(), LAYOUT_SWA)
    assert HandoffHeader.decode(_tamper(h, params={"max_tokens": 3})).params == SamplingParams(max_tokens=3)
    with pytest.raises(HandoffError) as e:
        HandoffHeader.decode(_tamper(h, params={"top_k": "x"}))
    assert e.value.code == BAD_HEADER and "params.top_k" in e.value.message


def test_offer_fields_round_trip_and_nested_dataclasses_are_still_encoded() -> None:
    """An offer's transport fields (Any) go as plain values (tuples as lists, bytes and None as they are),
    and a dataclass nested anywhere in them is still encoded as its map."""
    extra = {"host": "h", "offsets": (None, 64), "pool": {"pages": (3, 1, 2), "handle": {"k": b"\x00\x01"}, "event": None}}
    got = unpack(msgpack.unpackb(pack(Offer("ipc", b"hdr", extra))[4:], raw=False), "peer")
    assert isinstance(got, Offer) and got.header == b"hdr"
    assert got.extra == {"host": "h", "offsets": [None, 64], "pool": {"pages": [3, 1, 2], "handle": {"k": b"\x00\x01"}, "event": None}}
    lp = TokenLogprob(5, -0.5, ((5, -0.5),))
    assert to_wire({"a": [1, lp], "b": (lp,), "c": {"d": lp}}) == {
        "a": [1, to_wire(lp)], "b": [to_wire(lp)], "c": {"d": to_wire(lp)}
    }
    assert to_wire(lp) == {"token_id": 5, "logprob": -0.5, "top": [[5, -0.5]]}


def test_header_decode_refuses_garbage() -> None:
    for data in (b"", b"\xc1", msgpack.packb([1, 2, 3])):
        with pytest.raises(HandoffError) as e:
            HandoffHeader.decode(data)
        assert e.value.code in (BAD_HEADER, VERSION)


def test_check_layout() -> None:
    h = make_header(make_export(), LAYOUT_SWA, model="model-a")
    check_layout(h, LAYOUT_SWA, "model-a")
    check_layout(h, LAYOUT_SWA)  # no model given: layout only
    assert KVLayout.from_fields(LAYOUT_SWA.fields()) == LAYOUT_SWA
    for other, what in [
        (dataclasses.replace(LAYOUT_SWA, block_size=32), "block_size"),
        (dataclasses.replace(LAYOUT_SWA, dtype=torch.bfloat16), "dtype"),
        (dataclasses.replace(LAYOUT_SWA, num_kv_heads=4), "num_kv_heads"),
        (dataclasses.replace(LAYOUT_SWA, window=32), "window"),
    ]:
        with pytest.raises(HandoffError) as e:
            check_layout(h, other, "model-a")
        assert e.value.code == LAYOUT and what in e.value.message
    with pytest.raises(HandoffError) as e:
        check_layout(h, LAYOUT_SWA, "model-b")
    assert e.value.code == LAYOUT and "model" in e.value.message


def test_latent_pages_travel_as_one_plane_per_layer() -> None:
    """A latent (MLA) layout: a page holds one latent per token and layer, the header says so, and a
    receiver whose pages are K and V refuses it even where the byte sizes agree."""
    lo = LAYOUT_LATENT
    assert lo.page_shape(2) == (2, 3, 1, 16, 1, 40) and lo.planes == 1 and lo.token_bytes == 40 * 4
    assert lo.page_bytes == 3 * 16 * lo.token_bytes and LAYOUT_SWA.token_bytes == 2 * 2 * 8 * 4
    exp = make_export(lo, num_prompt=37)
    h = make_header(exp, lo, model="m")
    back = HandoffHeader.decode(h.encode())
    assert back == h and back.page_kind == "latent" and back.layout == lo
    assert back.payload_bytes == 3 * lo.page_bytes and back.page_shape == exp.pages.shape
    check_layout(back, lo, "m")
    assert torch.equal(to_export(back, payload_segments(exp, lo)).pages, exp.pages)
    same_bytes = dataclasses.replace(lo, page_kind="kv", head_dim=20)
    assert same_bytes.page_bytes == lo.page_bytes
    with pytest.raises(HandoffError) as e:
        check_layout(back, same_bytes, "m")
    assert e.value.code == LAYOUT and "page_kind" in e.value.message
    assert KVLayout.from_fields(lo.fields()) == lo
    for bad in ({**lo.fields(), "page_kind": "mla"}, {**lo.fields(), "num_kv_heads": 2}):
        with pytest.raises(ValueError):
            KVLayout.from_fields(bad)


def test_make_header_refuses_tensors_of_another_layout() -> None:
    exp = make_export()
    with pytest.raises(HandoffError) as e:
        make_header(exp, dataclasses.replace(LAYOUT_SWA, head_dim=16))
    assert e.value.code == LAYOUT
    exp.state = None
    with pytest.raises(HandoffError):
        make_header(exp, LAYOUT_SWA)


# ---- token ------------------------------------------------------------------------------------


def test_load_token(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="no cluster token"):
        auth.load_token()
    monkeypatch.setenv(auth.TOKEN_ENV, "short")
    with pytest.raises(ValueError, match="at least"):
        auth.load_token()
    monkeypatch.setenv(auth.TOKEN_ENV, "a" * 20)
    assert auth.load_token() == b"a" * 20
    f = tmp_path / "token"
    f.write_text(auth.generate_token() + "\n")
    f.chmod(0o600)
    monkeypatch.delenv(auth.TOKEN_ENV)
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(f))
    assert auth.load_token() == f.read_text().strip().encode()
    assert auth.load_token(token_file=f) == auth.load_token()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_load_token_refuses_a_file_others_can_access(tmp_path, mode: int) -> None:
    f = tmp_path / "token"
    f.write_text(auth.generate_token() + "\n")
    f.chmod(mode)
    with pytest.raises(ValueError, match=re.escape(f"readable by others (mode {mode:o}): chmod 600 {f}")):
        auth.load_token(token_file=f)
    f.chmod(0o400)
    assert auth.load_token(token_file=f) == f.read_text().strip().encode()
