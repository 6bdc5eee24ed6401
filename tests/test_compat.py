"""grpo_parts.compat: the same behaviour under every transformers release in range (the core suite
runs under 5.10 in .venv, the newest release in .venvs/latest and the declared floor in
.venvs/floor: scripts/ci/test-transformers-range.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from grpo_parts import compat
from grpo_parts.decoding import kv_room
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.tiny import tiny_causal_lm

B, H, D, LAYERS = 3, 2, 4, 2


def _filled_cache(length: int = 5) -> tuple[object, list[tuple[torch.Tensor, torch.Tensor]]]:
    cache = compat.new_dynamic_cache()
    gen = torch.Generator().manual_seed(0)
    kv = []
    for layer in range(LAYERS):
        k, v = (torch.randn(B, H, length, D, generator=gen) for _ in range(2))
        cache.update(k, v, layer)  # type: ignore[attr-defined]
        kv.append((k, v))
    return cache, kv


def _layers(cache: object) -> list[object]:
    layers = compat.cache_layers(cache)
    assert layers is not None and len(layers) == LAYERS
    return layers


def test_transformers_version() -> None:
    major, minor = compat.transformers_version()
    assert transformers.__version__.startswith(f"{major}.{minor}.")


@pytest.mark.parametrize("length", [0, 1, 3, 5])
def test_crop_cache_keeps_the_first_length_positions(length: int) -> None:
    """crop to 0 empties the cache (5.15+'s crop(0) is a no-op); to the full length changes nothing."""
    cache, kv = _filled_cache(5)
    compat.crop_cache(cache, length)
    assert cache.get_seq_length() == length  # type: ignore[attr-defined]
    for ly, (k, v) in zip(_layers(cache), kv):
        assert torch.equal(ly.keys, k[:, :, :length]) and torch.equal(ly.values, v[:, :, :length])  # type: ignore[attr-defined]


def test_crop_cache_to_its_length_leaves_the_tensors_alone() -> None:
    cache, _ = _filled_cache(4)
    before = [ly.keys for ly in _layers(cache)]  # type: ignore[attr-defined]
    compat.crop_cache(cache, 4)
    assert all(ly.keys is b for ly, b in zip(_layers(cache), before))  # type: ignore[attr-defined]


@pytest.mark.parametrize("length", [-1, 6])
def test_crop_cache_refuses_lengths_outside_the_cache(length: int) -> None:
    cache, _ = _filled_cache(5)
    with pytest.raises(GRPOPartsError, match=r"crop_cache: length expected in \[0, 5\]"):
        compat.crop_cache(cache, length)


def test_select_and_repeat_cache_rows() -> None:
    cache, kv = _filled_cache(3)
    idx = torch.tensor([2, 0])
    compat.select_cache_rows(cache, idx)
    for ly, (k, v) in zip(_layers(cache), kv):
        assert torch.equal(ly.keys, k[idx]) and torch.equal(ly.values, v[idx])  # type: ignore[attr-defined]
    compat.repeat_cache_rows(cache, 2)
    for ly, (k, _) in zip(_layers(cache), kv):
        assert torch.equal(ly.keys, k[idx].repeat_interleave(2, 0))  # type: ignore[attr-defined]


def test_cache_layers_is_none_without_per_layer_tensors() -> None:
    assert compat.cache_layers(object()) is None
    assert compat.cache_layers(compat.new_dynamic_cache()) is None  # no layer filled yet


def test_cropped_model_cache_continues_like_a_fresh_forward() -> None:
    """End to end on a model's own cache: prefill 7 tokens, crop to 4, feed 2 more == forward of 6."""
    model = tiny_causal_lm("qwen2", vocab_size=32, dtype=torch.float64)
    ids = torch.randint(1, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    new = torch.randint(1, 32, (2, 2), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = compat.output_cache(model(input_ids=ids, use_cache=True))
        compat.crop_cache(cache, 4)
        pos = torch.arange(4, 6).expand(2, 2)
        got = model(input_ids=new, position_ids=pos, use_cache=True, **{compat.cache_kwarg(model): cache})
        want = model(input_ids=torch.cat([ids[:, :4], new], 1)).logits[:, 4:]
    torch.testing.assert_close(got.logits, want, rtol=0, atol=1e-12)
    assert compat.output_cache(got).get_seq_length() == 6


class _OldStyle(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None):  # type: ignore[no-untyped-def]
        return input_ids


class _NewStyle(torch.nn.Module):
    def forward(self, input_ids=None, cache=None):  # type: ignore[no-untyped-def]
        return input_ids


class _Wrapper(torch.nn.Module):
    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return args


def test_cache_kwarg_follows_the_signature() -> None:
    release_default = "cache" if compat.transformers_version() >= (5, 24) else "past_key_values"
    assert compat.cache_kwarg(_OldStyle()) == "past_key_values"
    assert compat.cache_kwarg(_NewStyle()) == "cache"
    assert compat.cache_kwarg(_Wrapper()) == release_default
    model = tiny_causal_lm("llama", vocab_size=16)
    assert compat.cache_kwarg(model) == release_default
    assert compat.cache_kwarg(model.model.layers[0]) == release_default  # type: ignore[union-attr, index]


def test_output_cache_names_what_is_missing() -> None:
    model = tiny_causal_lm("qwen2", vocab_size=16)
    ids = torch.ones(1, 3, dtype=torch.long)
    with torch.no_grad():
        assert compat.output_cache(model(input_ids=ids, use_cache=True)).get_seq_length() == 3
        with pytest.raises(GRPOPartsError, match="is None .*use_cache=True"):
            compat.output_cache(model(input_ids=ids, use_cache=False))
    with pytest.raises(GRPOPartsError, match="expected a 'cache' or 'past_key_values' field"):
        compat.output_cache(object())


def test_registered_attention_function_runs_and_is_restored() -> None:
    model = tiny_causal_lm("qwen2", vocab_size=16, num_kv_heads=2, dtype=torch.float64)
    calls = []

    def spy(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        calls.append(attention_mask.dtype)
        return compat.sdpa_attention_forward()(module, query, key, value, attention_mask, **kw)

    compat.register_attention_function("grpo_test_spy", spy, mask="sdpa")
    ids = torch.randint(1, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: a mask is built (and passed) for every layer
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        with compat.select_attention(model, "grpo_test_spy"):
            assert model.config._attn_implementation == "grpo_test_spy"  # type: ignore[union-attr]
            out = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"  # type: ignore[union-attr]
    assert calls == [torch.bool] * 2  # both layers, with SDPA's boolean mask
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-12)
    with pytest.raises(GRPOPartsError, match="mask: expected one of"):
        compat.register_attention_function("grpo_test_spy", spy, mask="flex")


def test_attn_implementation_choice() -> None:
    class NoSdpa:
        _supports_sdpa = False

    class Sdpa:
        _supports_sdpa = True

    assert compat.attn_implementation(Sdpa) == "sdpa"
    assert compat.attn_implementation(NoSdpa) == "eager"
    assert compat.attn_implementation(NoSdpa, "eager") == "eager"
    with pytest.raises(NotSupportedError, match="NoSdpa.*attn_implementation='sdpa' is not supported"):
        compat.attn_implementation(NoSdpa, "sdpa")
    gemma2 = compat.causal_lm_class(transformers.Gemma2Config())
    assert gemma2.__name__ == "Gemma2ForCausalLM"
    # gemma2 lost SDPA in 5.21; tiny models then build with eager instead of failing in from_config
    want = "eager" if compat.transformers_version() >= (5, 21) else "sdpa"
    assert compat.attn_implementation(gemma2) == want
    model = tiny_causal_lm("gemma2", vocab_size=16)
    assert model.config._attn_implementation == want  # type: ignore[union-attr]
    with pytest.raises(GRPOPartsError, match="has no AutoModelForCausalLM class"):
        compat.causal_lm_class(transformers.CLIPVisionConfig())


def test_accepts_logits_to_keep() -> None:
    assert compat.accepts_logits_to_keep(tiny_causal_lm("qwen2", vocab_size=16))
    assert not compat.accepts_logits_to_keep(torch.nn.Linear(2, 2))


def test_portable_tokenizer_config(tmp_path: Path) -> None:
    from grpo_parts.task.tokenizer import build_hf_tokenizer
    from grpo_parts.train.lifecycle.setup import builtin_model_path

    tok = build_hf_tokenizer()
    tok.save_pretrained(tmp_path)
    compat.portable_tokenizer_config(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded("12+3=").input_ids == tok("12+3=").input_ids
    shipped = json.loads((Path(builtin_model_path()) / "tokenizer_config.json").read_text())
    assert shipped["tokenizer_class"] == "PreTrainedTokenizerFast"  # loads under 4.x too


def test_reserved_cache_room_appends_in_place_and_equals_cat() -> None:
    """A layer with room holds exactly what ``torch.cat`` would after appends, crops (which keep
    the buffer), row selection (one gather of the buffer) and a replacement of the tensors (a new
    buffer at the next append); appends within the room do not reallocate."""
    gen = torch.Generator().manual_seed(0)
    plain, kv = _filled_cache(3)
    roomy, _ = _filled_cache(3)
    assert kv_room.reserve_cache_room(roomy, 4) == len(_layers(roomy))

    def both(fn: object) -> None:
        for c in (plain, roomy):
            fn(c)  # type: ignore[operator]
        for a, b in zip(_layers(plain), _layers(roomy)):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # type: ignore[attr-defined]

    def append(t: int) -> object:
        k, v = (torch.randn(3, 2, t, 4, generator=gen) for _ in range(2))
        return lambda c: [ly.update(k[: ly.keys.shape[0]], v[: ly.keys.shape[0]]) for ly in _layers(c)]

    ptr = [ly.keys.data_ptr() for ly in _layers(roomy)]  # type: ignore[attr-defined]
    kv_room.reserve_cache_room(roomy, 4)  # again: the buffers are kept, not copied
    assert [ly.keys.data_ptr() for ly in _layers(roomy)] == ptr  # type: ignore[attr-defined]
    both(append(2))  # the buffers exist from reserve_cache_room on: the first append writes in place
    assert [ly.keys.data_ptr() for ly in _layers(roomy)] == ptr  # type: ignore[attr-defined]
    both(append(3))  # past the room (3 + 4 columns): regrown
    ptr = [ly.keys.data_ptr() for ly in _layers(roomy)]  # type: ignore[attr-defined]
    both(lambda c: compat.crop_cache(c, 6))
    both(append(1))  # writes over the cropped column
    assert [ly.keys.data_ptr() for ly in _layers(roomy)] == ptr  # type: ignore[attr-defined]
    both(lambda c: compat.select_cache_rows(c, torch.tensor([2, 0])))
    both(append(2))
    both(lambda c: [setattr(ly, "keys", ly.keys.clone()) for ly in _layers(c)])  # e.g. compaction
    both(append(5))  # past the room: regrown
    assert roomy.get_seq_length() == 14  # type: ignore[attr-defined]
    assert kv and all(type(ly).__name__ == "DynamicLayer" for ly in _layers(roomy))


def test_cache_room_grows_geometrically() -> None:
    """Growing a 100-column cache one column at a time to 400 copies it a handful of times (room for
    a quarter of what it holds at each regrowth), not once per ``slack`` columns; values stay cat's."""
    gen = torch.Generator().manual_seed(2)
    plain, _ = _filled_cache(100)
    roomy, _ = _filled_cache(100)
    kv_room.reserve_cache_room(roomy, 4)
    copies, ptr = 0, _layers(roomy)[0].keys.data_ptr()  # type: ignore[attr-defined]
    for _ in range(300):
        k, v = (torch.randn(B, H, 1, D, generator=gen) for _ in range(2))
        for c in (plain, roomy):
            for ly in _layers(c):
                ly.update(k, v)  # type: ignore[attr-defined]
        now = _layers(roomy)[0].keys.data_ptr()  # type: ignore[attr-defined]
        copies, ptr = copies + (now != ptr), now
    assert copies <= 6, copies  # 100 -> 125 -> 156 -> 195 -> 243 -> 304 -> 380 -> (400 fits)
    for a, b in zip(_layers(plain), _layers(roomy)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # type: ignore[attr-defined]


def test_cache_room_is_capped() -> None:
    """A long cache gets at most ``ROOM_MAX`` spare columns (GPU memory), at least ``slack``."""

    long, _ = _filled_cache(4000)
    kv_room.reserve_cache_room(long, 4)
    short, _ = _filled_cache(2)
    kv_room.reserve_cache_room(short, 4)
    assert _layers(long)[0]._kbuf.shape[2] == 4000 + kv_room.ROOM_MAX  # type: ignore[attr-defined]
    assert _layers(short)[0]._kbuf.shape[2] == 2 + 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("keep", [[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]])
@pytest.mark.parametrize("roomy", [True, False])
def test_drop_cache_rows_moves_the_last_live_rows_into_the_gaps(keep: list[int], roomy: bool) -> None:
    """``drop_cache_rows`` leaves every layer holding exactly the rows of the returned order (live
    rows only, each once, the first live ones in place), then appends like ``torch.cat``; layers
    with room move rows within their buffers (no reallocation), others gather."""
    gen = torch.Generator().manual_seed(1)
    cache, kv = _filled_cache(3)
    if roomy:
        kv_room.reserve_cache_room(cache, 4)
        for ly in _layers(cache):  # give the layers their buffers
            ly.update(*(torch.randn(B, H, 1, D, generator=gen) for _ in range(2)))  # type: ignore[attr-defined]
    before = [(ly.keys.clone(), ly.values.clone()) for ly in _layers(cache)]  # type: ignore[attr-defined]
    ptr = [ly.keys.data_ptr() for ly in _layers(cache)]  # type: ignore[attr-defined]
    live = torch.tensor(keep, dtype=torch.bool)
    order = kv_room.drop_cache_rows(cache, live)
    assert sorted(order.tolist()) == live.nonzero().squeeze(1).tolist()
    assert all(order[i] == i for i in range(order.numel()) if keep[i])  # live rows in place stay
    for ly, (k, v) in zip(_layers(cache), before):
        assert torch.equal(ly.keys, k[order]) and torch.equal(ly.values, v[order])  # type: ignore[attr-defined]
    if roomy:
        assert [ly.keys.data_ptr() for ly in _layers(cache)] == ptr  # type: ignore[attr-defined]
    new = [tuple(torch.randn(order.numel(), H, 2, D, generator=gen) for _ in range(2)) for _ in range(LAYERS)]
    for ly, (k, v), (nk, nv) in zip(_layers(cache), before, new):
        ly.update(nk, nv)  # type: ignore[attr-defined]
        assert torch.equal(ly.keys, torch.cat([k[order], nk], 2))  # type: ignore[attr-defined]
        assert torch.equal(ly.values, torch.cat([v[order], nv], 2))  # type: ignore[attr-defined]
    assert kv
