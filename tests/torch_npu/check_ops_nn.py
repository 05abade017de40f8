"""The nn family's operators on the simulated NPU against torch on the CPU, through the real
torch_npu wheel: forward and backward (autograd), non-contiguous inputs, three float dtypes,
int64 index inputs, and determinism (every NPU case runs twice and must give the same bits).

    python tests/torch_npu/check_ops_nn.py      (with torch_npu importable and the simulator's env)

One line per case: ``ok``/``FAIL``, the case, the dtype, the largest error seen. Exit status 1 on
any failure. Tolerances: |npu - cpu| <= atol + rtol * |cpu| with
  float32:  rtol 1e-5, atol 1e-6 (exact cases: 0)
  float16:  rtol 1e-2, atol 1e-3 (both sides compute in float and round to half; a gradient that
            goes through several half roundings may differ by a few half ulps)
  bfloat16: rtol 4e-2, atol 1e-2 (8 significant bits: one ulp is 0.4-0.8 %)
The CPU computes in the same dtype as the NPU (the CPU's half and bfloat16 kernels also compute
in float and round once per op).
"""

from __future__ import annotations

import sys
from typing import Callable, List, Sequence

import torch
import torch.nn.functional as F
import torch_npu

DEV = "npu"
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (4e-2, 1e-2),
}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
failures: List[str] = []
CUR = "cpu"  # the device the case now runs on (for cases without inputs)


def emit(ok: bool, name: str, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name:44s} {detail}", flush=True)
    if not ok:
        failures.append(name)


def max_err(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """Whether got (from the NPU) is within tolerance of want (CPU); the largest |got - want|."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, float("inf")
    if not got.dtype.is_floating_point:
        return bool(torch.equal(got, want)), float((got != want).sum())
    g, w = got.double(), want.double()
    nan_ok = torch.equal(torch.isnan(g), torch.isnan(w))
    g, w = torch.nan_to_num(g, nan=0.0), torch.nan_to_num(w, nan=0.0)
    inf_ok = torch.equal(torch.isinf(g), torch.isinf(w)) and torch.equal(g[torch.isinf(g)], w[torch.isinf(w)])
    fin = torch.isfinite(w)
    diff = (g[fin] - w[fin]).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    ok = bool((diff <= atol + rtol * w[fin].abs()).all()) and nan_ok and inf_ok
    return ok, err


def bits_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    for x, y in zip(a, b):
        if x.dtype.is_floating_point:
            x, y = (
                x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32),
                y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32),
            )
        if not torch.equal(x, y):
            return False
    return True


def run(
    name: str,
    fn: Callable[..., object],
    make: Callable[[], Sequence[torch.Tensor]],
    view: Callable[..., Sequence[torch.Tensor]],
    dtypes: Sequence[torch.dtype] = FLOATS,
    grad: bool = True,
    exact: bool = False,
    nograd: Sequence[int] = (),
) -> None:
    """make() -> CPU leaves (float ones are cast to the dtype and get gradients); view(*leaves) ->
    the (non-contiguous) inputs fn sees. Outputs and the leaves' gradients are compared (but for
    the leaves listed in nograd)."""
    for dt in dtypes:
        label = f"{name} [{str(dt).replace('torch.', '')}]"
        rtol, atol = (0.0, 0.0) if exact else TOL[dt]
        try:
            base = [t.to(dt) if t.dtype.is_floating_point else t for t in make()]

            def once(dev: str, base: List[torch.Tensor] = base) -> List[torch.Tensor]:
                global CUR
                CUR = dev
                leaves = [t.detach().clone().to(dev) for t in base]
                wants = [grad and t.dtype.is_floating_point and j not in nograd for j, t in enumerate(leaves)]
                for t, w in zip(leaves, wants):
                    t.requires_grad_(w)
                out = fn(*view(*leaves))
                outs = list(out) if isinstance(out, (tuple, list)) else [out]
                res = [o.detach().cpu() for o in outs]
                if grad:
                    floats = [o for o in outs if o.dtype.is_floating_point and o.requires_grad]
                    gen = torch.Generator().manual_seed(7)
                    seeds = [torch.randn(o.shape, generator=gen).to(o.dtype).to(dev) for o in floats]
                    torch.autograd.backward(floats, seeds)
                    res += [t.grad.cpu() for t, w in zip(leaves, wants) if w]
                return res

            try:
                want = once("cpu")
            except RuntimeError as e:
                if "not implemented for" in str(e):
                    print(f"skip {label:44s} the CPU oracle has no {dt} kernel", flush=True)
                    continue
                raise
            got = once(DEV)
            again = once(DEV)
            errs, ok = [], True
            for g, w in zip(got, want):
                o, e = max_err(g, w, rtol, atol)
                ok &= o
                errs.append(e)
            det = bits_equal(got, again)
            emit(
                ok and det and len(got) == len(want),
                label,
                f"max|err| {max(errs) if errs else 0:.3g}" + ("" if det else "  NOT DETERMINISTIC"),
            )
        except Exception as e:
            emit(False, label, f"raised {type(e).__name__}: {str(e).splitlines()[0][:150]}")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def randint(hi: int, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, hi, shape, generator=torch.Generator().manual_seed(seed))


def ident(*xs: torch.Tensor) -> Sequence[torch.Tensor]:
    return xs


def main() -> int:
    T = lambda x: x.transpose(0, 1)  # noqa: E731
    # softmax family: a transposed input, a strided slice, a 3-D view along a middle dim
    run("softmax dim=-1 transposed", lambda x: F.softmax(x, -1), lambda: [randn(7, 5)], lambda x: [T(x)])
    run(
        "softmax dim=1 3-D permuted",
        lambda x: F.softmax(x, 1),
        lambda: [randn(3, 4, 6)],
        lambda x: [x.permute(2, 0, 1)],
    )
    run(
        "log_softmax dim=0 sliced",
        lambda x: F.log_softmax(x, 0),
        lambda: [randn(6, 10)],
        lambda x: [x[1:, ::2]],
    )
    run(
        "log_softmax dim=-1 offset",
        lambda x: F.log_softmax(x, -1),
        lambda: [randn(4, 9)],
        lambda x: [x[2:, 1:]],
    )
    run(
        "softmax with -inf (causal mask added)",
        lambda x: F.softmax(x + torch.full((4, 4), float("-inf")).triu(1).to(x.dtype).to(x.device), -1),
        lambda: [randn(4, 4)],
        ident,
    )
    # LayerNorm: weight and bias, none, two normalized dims; a transposed input
    run(
        "layer_norm w,b transposed",
        lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5),
        lambda: [randn(8, 3, 5), randn(8, seed=2), randn(8, seed=3)],
        lambda x, w, b: [x.permute(1, 2, 0), w, b],
    )
    run(
        "layer_norm no affine",
        lambda x: F.layer_norm(x, (6,)),
        lambda: [randn(5, 6)],
        lambda x: [x[1:]],
    )
    run(
        "layer_norm 2 dims, w only",
        lambda x, w: F.layer_norm(x, (3, 4), w, None, 1e-6),
        lambda: [randn(2, 3, 4), randn(3, 4, seed=4)],
        ident,
    )
    # RMS norm through torch_npu's own op
    run(
        "npu_rms_norm vs formula",
        lambda x, g: (
            torch_npu.npu_rms_norm(x, g, 1e-6)[0]
            if x.device.type == "npu"
            else (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()).to(
                x.dtype
            )
        ),
        lambda: [randn(4, 8), randn(8, seed=5)],
        lambda x, g: [x, g],
        dtypes=(torch.float32,),
    )
    # Losses: NLLLoss with weights, ignore_index, each reduction; int64 targets from a slice
    for red in ("none", "mean", "sum"):
        run(
            f"nll_loss {red} weight ignore_index",
            lambda x, w, t, red=red: F.nll_loss(
                F.log_softmax(x, -1), t, weight=w, ignore_index=2, reduction=red
            ),
            lambda: [randn(8, 5), randn(5, seed=6).abs() + 0.5, randint(5, 16)],
            lambda x, w, t: [x, w, t[::2]],
            nograd=(1,),
        )
    run(
        "cross_entropy",
        lambda x, t: F.cross_entropy(x, t),
        lambda: [randn(6, 7), randint(7, 6)],
        lambda x, t: [T(T(x)), t],
    )
    run(
        "cross_entropy [N, C, d] (nll_loss2d)",
        lambda x, t: F.cross_entropy(x, t, ignore_index=1),
        lambda: [randn(2, 5, 4), randint(5, 2, 4)],
        lambda x, t: [x, t],
    )
    run(
        "nll_loss2d none, weight",
        lambda x, w, t: F.nll_loss(x, t, weight=w, reduction="none"),
        lambda: [randn(2, 4, 3, 5), randn(4, seed=2).abs(), randint(4, 2, 3, 5)],
        ident,  # the CPU oracle needs a contiguous input here
        nograd=(1,),
    )
    run("nll_loss 1-D input", lambda x, t: F.nll_loss(x, t), lambda: [randn(5), torch.tensor(3)], ident)
    for red in ("none", "mean", "sum"):
        run(
            f"mse_loss {red}",
            lambda a, b, red=red: F.mse_loss(a, b, reduction=red),
            lambda: [randn(4, 6), randn(6, 4, seed=8)],
            lambda a, b: [a, T(b)],
        )
    # Activations
    run("relu (threshold_backward)", F.relu, lambda: [randn(5, 6)], lambda x: [T(x)])
    run("gelu (erf)", F.gelu, lambda: [randn(5, 6)], lambda x: [x[:, 1:]])
    # Embedding: int64 indices, 2-D and a non-contiguous slice; padding_idx; scale_grad_by_freq
    run(
        "embedding",
        lambda w, i: F.embedding(i, w),
        lambda: [randn(10, 4), randint(10, 3, 8)],
        lambda w, i: [w, i[:, ::2]],
    )
    run(
        "embedding padding_idx scale_by_freq",
        lambda w, i: F.embedding(i, w, padding_idx=1, scale_grad_by_freq=True),
        lambda: [randn(6, 5), torch.tensor([[1, 2, 2, 5], [0, 1, 2, 2]])],
        ident,
    )
    # Matrix products with a bias
    run(
        "linear (addmm)",
        F.linear,
        lambda: [randn(4, 6), randn(3, 6, seed=2), randn(3, seed=3)],
        lambda x, w, b: [x, w, b],
    )
    run(
        "addmm beta alpha transposed",
        lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        lambda: [randn(4, 3), randn(5, 4, seed=2), randn(5, 3, seed=3)],
        lambda c, a, b: [c, T(a), b],
    )
    run(
        "baddbmm",
        lambda c, a, b: torch.baddbmm(c, a, b, beta=0.25, alpha=-1.5),
        lambda: [randn(2, 3, 5), randn(2, 3, 4, seed=2), randn(2, 5, 4, seed=3)],
        lambda c, a, b: [c, a, b.transpose(1, 2)],
    )
    # Shapes: exact
    run("tril diagonal -1", lambda x: torch.tril(x, -1), lambda: [randn(5, 6)], lambda x: [T(x)], exact=True)
    run(
        "triu diagonal 1 batched",
        lambda x: torch.triu(x, 1),
        lambda: [randn(2, 4, 5)],
        lambda x: [x[:, 1:]],
        exact=True,
    )
    run("tril_ in place", lambda x: x.clone().tril_(), lambda: [randn(4, 4)], ident, exact=True)
    run(
        "cat dim 1 mixed views",
        lambda a, b: torch.cat([a, b, a[:, :1]], 1),
        lambda: [randn(3, 4), randn(5, 3, seed=2)],
        lambda a, b: [a, T(b)],
        exact=True,
    )
    run(
        "cat dim 0",
        lambda a, b: torch.cat([a, b]),
        lambda: [randn(2, 4), randn(3, 4, seed=2)],
        ident,
        exact=True,
    )
    run(
        "stack dim 1",
        lambda a, b: torch.stack([a, b], 1),
        lambda: [randn(3, 4), randn(4, 3, seed=2)],
        lambda a, b: [a, T(b)],
        exact=True,
    )
    # Generation ops (forward; int64 indices)
    run(
        "argmax dim=-1",
        lambda x: x.argmax(-1),
        lambda: [randn(4, 7)],
        lambda x: [T(T(x))],
        grad=False,
        exact=True,
    )
    run(
        "argmax keepdim dim=0",
        lambda x: x.argmax(0, keepdim=True),
        lambda: [randn(5, 6)],
        lambda x: [T(x)],
        grad=False,
        exact=True,
    )
    run("argmax all", lambda x: x.argmax(), lambda: [randn(5, 6)], ident, grad=False, exact=True)
    run(
        "topk largest (+scatter bwd)",
        lambda x: torch.topk(x, 3, -1),
        lambda: [randn(4, 9)],
        lambda x: [x[:, 1:]],
        exact=True,
    )
    run(
        "topk smallest dim 0",
        lambda x: torch.topk(x, 2, 0, largest=False),
        lambda: [randn(6, 5)],
        lambda x: [T(x)],
        exact=True,
    )
    run(
        "index_select dim 1 (+index_add bwd)",
        lambda x, i: torch.index_select(x, 1, i),
        lambda: [randn(4, 6), torch.tensor([5, 0, 2, 2])],
        lambda x, i: [x, i],
    )
    run(
        "gather dim 1 (+scatter_add bwd)",
        lambda x, i: torch.gather(x, 1, i),
        lambda: [randn(4, 6), randint(6, 4, 3)],
        lambda x, i: [T(T(x)), i],
    )
    run(
        "index x[idx] and x[:, idx] (+index_put bwd)",
        lambda x, i: (x[i], x[:, i], x[i, 1:]),
        lambda: [randn(6, 6), torch.tensor([[0, 5], [3, 3]])],
        lambda x, i: [T(x), i],
    )
    run(
        "nonzero, x[bool mask], masked_select",
        lambda x, m: (
            torch.nonzero(m),
            x[m],
            x[:, m[0]],
            torch.masked_select(x, m),
            torch.masked_select(x, m[2]),
        ),
        lambda: [
            randn(4, 5),
            torch.tensor([[1, 0, 0, 2, 0], [0, 0, 0, 0, 0], [3, 3, 0, 1, 0], [0, 1, 0, 0, 1]]).bool(),
        ],
        lambda x, m: [T(T(x)), m],
    )
    run(
        "scatter, scatter_add, scatter value",
        lambda x, s, i: (
            x.scatter(1, i, s),
            x.scatter_add(0, i, s),
            x.scatter(1, i, 2.5),
        ),
        lambda: [randn(4, 6), randn(5, 5, seed=2), torch.tensor([[0, 3, 1], [3, 3, 3], [2, 0, 2]])],
        lambda x, s, i: [x, T(s), i],
        grad=False,
    )
    run(
        "index_add alpha, index_put accumulate",
        lambda x, s, i: (
            x.index_add(0, i, s, alpha=-2.0),
            x.index_put((i,), s, accumulate=True),
            x.index_put((i[:1],), s[0]),
        ),
        lambda: [randn(4, 3), randn(3, 5, seed=2), torch.tensor([3, 0, 3, 1, 0])],
        lambda x, s, i: [x, T(s), i],
    )
    run(
        "index x[i0, :, i1] (non-adjacent)",
        lambda x, a, b: x[a, :, b],
        lambda: [randn(4, 3, 5), torch.tensor([0, 3, 1]), torch.tensor([4, 0, 2])],
        ident,
        grad=False,
        exact=True,
    )
    # scaled_dot_product_attention: FlashAttentionScore (+Grad) for 4-D inputs (head dim a multiple
    # of 4 in float32); q/k/v as the usual transposed [B, T, H, D] views; a causal, a plain and a
    # grouped-query case (head dim 6, which op-plugin decomposes, runs last)
    bthd = lambda *ts: [t.transpose(1, 2) for t in ts]  # noqa: E731
    run(
        "sdpa causal (FlashAttentionScore)",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda: [randn(2, 5, 2, 8), randn(2, 5, 2, 8, seed=2), randn(2, 5, 2, 8, seed=3)],
        bthd,
    )
    run(
        "sdpa no mask, scale",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
        lambda: [randn(1, 3, 2, 4), randn(1, 6, 2, 4, seed=2), randn(1, 6, 2, 4, seed=3)],
        bthd,
    )
    run(
        "sdpa causal grouped-query",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        lambda: [randn(1, 6, 4, 8), randn(1, 6, 2, 8, seed=2), randn(1, 6, 2, 8, seed=3)],
        bthd,
    )
    run(
        "sort stable both ways (ties)",
        lambda x: (*torch.sort(x, dim=-1, stable=True), *torch.sort(x, dim=0, descending=True, stable=True)),
        lambda: [torch.tensor([[3.0, 1.0, 3.0, -2.0], [0.5, 0.5, 9.0, 1.0], [2.0, 7.0, 2.0, 2.0]])],
        lambda x: [T(T(x))],
        exact=True,
    )
    run(
        "repeat, repeat_interleave",
        lambda x: (x.repeat(2, 1, 3), x.repeat_interleave(2, dim=1), x.repeat_interleave(3)),
        lambda: [randn(3, 4)],
        lambda x: [T(x)],
    )
    # Arange (no inputs; an exact int case and float steps)
    for args in ((0, 7, 1), (2, -5, -2), (0.0, 1.0, 0.125)):
        run(
            f"arange{args}",
            lambda args=args: torch.arange(*args, device=CUR),
            lambda: [],
            ident,
            dtypes=(torch.float32,),
            grad=False,
            exact=True,
        )
    # Last, as it needs the math family's operators (IsNegInf, All, SWhere): a missing operator
    # fails the task queue for every later case.
    run(
        "sdpa head dim 6 (decomposed)",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        lambda: [randn(1, 4, 2, 6), randn(1, 4, 2, 6, seed=2), randn(1, 4, 2, 6, seed=3)],
        lambda q, k, v: [t.transpose(1, 2) for t in (q, k, v)],
        dtypes=(torch.float32,),
    )
    print(f"{len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
