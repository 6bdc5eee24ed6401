"""The ``sdpa`` kernel: shared-prefix attention as a log-sum-exp cascade of PyTorch's CPU
flash-attention ops (see :class:`_Cascade`), for the grid layout of :mod:`.layout`."""

from __future__ import annotations

from typing import Any

import torch

from .layout import PrefixLayout


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, l_, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, l_, d).reshape(b, h * n_rep, l_, d)


def flash_ops() -> tuple[Any, Any] | None:
    """PyTorch's CPU flash-attention ``(forward, backward)`` ops, or None where this torch lacks them."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if fwd is None or bwd is None else (fwd, bwd)


def _slot_tiles(g: int, rows_per_slot: int, elems_per_row: int, tile_elems: int) -> list[tuple[int, int]]:
    """Row ranges of the slot-major flat layout, whole slots per tile, about ``tile_elems`` scores each."""
    step = max(1, tile_elems // max(1, rows_per_slot * elems_per_row))
    return [(i * rows_per_slot, min(g, i + step) * rows_per_slot) for i in range(0, g, step)]


def _flat_slots(x: torch.Tensor, p: int, g: int, s: int, rep: int) -> torch.Tensor:
    """``[B, Hkv*rep, L, D]`` suffix part -> ``[G*B*Hkv, rep*S, D]`` (slot-major, contiguous copy):
    the grouped-query heads of one KV head become extra query rows of one small matmul."""
    b, h, _, d = x.shape
    y = x[:, :, p:].reshape(b, h // rep, rep, g, s, d).permute(3, 0, 1, 2, 4, 5)
    return y.reshape(g * b * (h // rep), rep * s, d).contiguous()


def _unflat_slots(y: torch.Tensor, b: int, hk: int, rep: int, g: int, s: int) -> torch.Tensor:
    """Inverse view of :func:`_flat_slots`: ``[B, Hkv, rep, G, S, ...]`` (no copy)."""
    return y.view(g, b, hk, rep, s, *y.shape[2:]).permute(1, 2, 3, 0, 4, *range(5, y.ndim + 3))


def _slots4(
    kf: torch.Tensor, vf: torch.Tensor, n: int, hk: int, rep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``[G*B*Hkv, S, D]`` suffix K/V -> ``[G*B, H, S, D]`` with KV heads repeated for flash."""
    s, d = kf.shape[1], kf.shape[2]
    return repeat_kv(kf.view(n, hk, s, d), rep), repeat_kv(vf.view(n, hk, s, d), rep)


class _Cascade(torch.autograd.Function):
    """Shared-prefix attention as two parts merged by log-sum-exp:

    (a) every query of the row against the prefix keys: one CPU flash call with ``is_causal``
        (top-left aligned, so a prefix query sees the prefix causally and a suffix query all of it);
    (b) each suffix against itself, causal: one batched matmul per tile of slots,
        ``[G*B*Hkv, rep*S, S]`` (grouped-query heads folded into query rows, not repeated), or for
        long suffixes (``S >= suffix_flash_min``) one flash call over ``[G*B, H, S, D]``.

    The flash op returns the LSE but not its gradient; backward is still exact because the flash
    backward of (a), given the *merged* output and LSE, yields (a)'s share of the joint softmax's
    gradient (it recomputes ``P = exp(S - LSE)`` and ``D = rowsum(dO * O)``); (b)'s backward is
    written out the same way. Inputs are the full ``q: [B, H, L, D]``, ``k, v: [B, Hkv, L, D]``
    so that no slicing/repeat backward allocates zero-filled full-size gradients."""

    @staticmethod
    def forward(ctx, q, k, v, bias, p, g, s, scale, tile, flash_b):  # type: ignore[override]
        fwd, _ = flash_ops()  # type: ignore[misc]
        b, h, length, d = q.shape
        hk = k.shape[1]
        rep = h // hk
        ctx.tile, ctx.flash_b = tile, flash_b
        kp, vp = repeat_kv(k[:, :, :p], rep), repeat_kv(v[:, :, :p], rep)
        out, lse = fwd(q, kp, vp, 0.0, True, attn_mask=bias, scale=scale)
        qf = _flat_slots(q, p, g, s, rep)
        kf, vf = _flat_slots(k, p, g, s, 1), _flat_slots(v, p, g, s, 1)
        if ctx.flash_b:  # long suffixes: flash (skips the causal upper triangle), heads repeated per slot
            ob4, lb4 = fwd(
                qf.reshape(g * b, h, s, d), *_slots4(kf, vf, g * b, hk, rep), 0.0, True, scale=scale
            )
            ob, lb = ob4.reshape(qf.shape), lb4.reshape(qf.shape[:2])
        else:
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().repeat(rep, 1)
            lb = q.new_empty(qf.shape[:2])
            ob = torch.empty_like(qf)
            for i, j in _slot_tiles(g, b * hk, rep * s * s, ctx.tile):
                sc = (
                    torch.bmm(qf[i:j], kf[i:j].transpose(1, 2))
                    .mul_(scale)
                    .masked_fill_(~causal, float("-inf"))
                )
                torch.logsumexp(sc, -1, out=lb[i:j])
                torch.bmm(sc.sub_(lb[i:j].unsqueeze(-1)).exp_(), vf[i:j], out=ob[i:j])
        la = lse[:, :, p:].view(b, hk, rep, g, s)
        lbv = _unflat_slots(lb, b, hk, rep, g, s)
        ls = torch.logaddexp(la, lbv)
        out_s = out[:, :, p:].view(b, hk, rep, g, s, d)
        out_s.mul_((la - ls).exp_().unsqueeze(-1)).add_(
            _unflat_slots(ob, b, hk, rep, g, s) * (lbv - ls).exp_().unsqueeze(-1)
        )
        la.copy_(ls)
        ctx.save_for_backward(
            q, k, v, kp, vp, bias if bias is not None else torch.empty(0), out, lse, qf, kf, vf
        )
        ctx.has_bias, ctx.scale, ctx.dims = bias is not None, scale, (p, g, s)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        _, bwd = flash_ops()  # type: ignore[misc]
        q, k, v, kp, vp, bias, out, lse, qf, kf, vf = ctx.saved_tensors
        p, g, s = ctx.dims
        b, h, length, d = q.shape
        hk = k.shape[1]
        rep, scale = h // hk, ctx.scale
        dout = dout.contiguous()
        dq, dkp, dvp = bwd(
            dout, q, kp, vp, out, lse, 0.0, True, attn_mask=bias if ctx.has_bias else None, scale=scale
        )
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dk[:, :, :p] = dkp.view(b, hk, rep, p, d).sum(2)
        dv[:, :, :p] = dvp.view(b, hk, rep, p, d).sum(2)
        dof = _flat_slots(dout, p, g, s, rep)
        delta = (dout * out).sum(-1, keepdim=True)  # [B, H, L, 1] (prefix rows unused)
        lsf = _flat_slots(lse.unsqueeze(-1), p, g, s, rep)  # merged LSE, [G*B*Hkv, rep*S, 1]
        deltaf = _flat_slots(delta, p, g, s, rep)
        if ctx.flash_b:
            k4, v4 = _slots4(kf, vf, g * b, hk, rep)
            do4, q4, o4 = (x.reshape(g * b, h, s, d) for x in (dof, qf, _flat_slots(out, p, g, s, rep)))
            dq4, dk4, dv4 = bwd(do4, q4, k4, v4, o4, lsf.reshape(g * b, h, s), 0.0, True, scale=scale)
            dqf = dq4.reshape(qf.shape)
            dkf = dk4.reshape(g * b, hk, rep, s, d).sum(2).reshape(kf.shape)
            dvf = dv4.reshape(g * b, hk, rep, s, d).sum(2).reshape(vf.shape)
            tiles: list[tuple[int, int]] = []
        else:
            dqf = torch.empty_like(qf)
            dkf = torch.empty_like(kf)
            dvf = torch.empty_like(vf)
            tiles = _slot_tiles(g, b * hk, rep * s * s, ctx.tile)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().repeat(rep, 1)
        for i, j in tiles:
            sc = torch.bmm(qf[i:j], kf[i:j].transpose(1, 2)).mul_(scale).masked_fill_(~causal, float("-inf"))
            pr = sc.sub_(lsf[i:j]).exp_()  # this part's share of the joint softmax
            torch.bmm(pr.transpose(1, 2), dof[i:j], out=dvf[i:j])
            ds = torch.bmm(dof[i:j], vf[i:j].transpose(1, 2)).sub_(deltaf[i:j]).mul_(pr).mul_(scale)
            torch.bmm(ds, kf[i:j], out=dqf[i:j])
            torch.bmm(ds.transpose(1, 2), qf[i:j], out=dkf[i:j])
        dq[:, :, p:].view(b, hk, rep, g, s, d).add_(_unflat_slots(dqf, b, hk, rep, g, s))
        dk[:, :, p:].view(b, hk, g, s, d).copy_(_unflat_slots(dkf, b, hk, 1, g, s).squeeze(2))
        dv[:, :, p:].view(b, hk, g, s, d).copy_(_unflat_slots(dvf, b, hk, 1, g, s).squeeze(2))
        return dq, dk, dv, None, None, None, None, None, None, None


def same_head_size(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``fn(q, k, v)`` with one head size, as the flash ops need: with multi-head latent attention (MLA:
    DeepSeek-V2/V3, MiniCPM3; ``Dv != D``) the smaller side is zero-padded, which changes neither the scores
    (the caller's ``scale`` is explicit) nor the output's first ``Dv`` columns, nor their gradients."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return fn(q, k, torch.nn.functional.pad(v, (0, d - dv)))[..., :dv]  # type: ignore[no-any-return]
    if dv > d:
        q, k = torch.nn.functional.pad(q, (0, dv - d)), torch.nn.functional.pad(k, (0, dv - d))
    return fn(q, k, v)  # type: ignore[no-any-return]


def sdpa_cascade(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PrefixLayout, scale: float
) -> torch.Tensor:
    """``q: [B, H, L, D]``, ``k: [B, Hkv, L, D]``, ``v: [B, Hkv, L, Dv]`` (not repeated) ->
    ``[B, H, L, Dv]`` (MLA's ``Dv != D`` through :func:`same_head_size`)."""
    bias = None
    if lay.prefix_valid is not None:
        bias = torch.zeros(lay.prefix_valid.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~lay.prefix_valid, float("-inf"))[:, None, None, :]
    flash_b = lay.slot_len >= lay.suffix_flash_min
    return same_head_size(
        lambda q_, k_, v_: _Cascade.apply(
            q_, k_, v_, bias, lay.prefix_len, lay.num_slots, lay.slot_len, scale, lay.tile_elems, flash_b
        ),
        q, k, v,
    )  # fmt: skip
