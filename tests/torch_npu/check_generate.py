"""Greedy decoding with a tiny GPT-style model on the simulated NPU, token for token against the CPU,
through the real torch_npu wheel.

    python tests/torch_npu/check_generate.py      (with torch_npu importable and the simulator's env)

The model is built here with a fixed seed (embedding, RMSNorm, causal self-attention through
scaled_dot_product_attention with a key/value cache grown by torch.cat, a SiLU-gated MLP, a linear
head); the same weights run on the CPU and on the NPU. A prompt of 6 tokens is prefilled, then 20
tokens are decoded one at a time (argmax of the last position's logits). The NPU's tokens must
equal the CPU's, its last logits be within 1e-4 of the CPU's (relative to their largest
magnitude), the top-5 of every step agree, and a second NPU run give the same bits. Prints one line
per check; exit status 1 on any failure.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu  # noqa: F401  (registers the npu device)

V, D, H, L, PROMPT, NEW = 64, 32, 4, 2, 6, 20
HD = D // H

Cache = List[Optional[Tuple[torch.Tensor, torch.Tensor]]]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1 = nn.RMSNorm(D, eps=1e-6)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.n2 = nn.RMSNorm(D, eps=1e-6)
        self.w1 = nn.Linear(D, 2 * D, bias=False)
        self.w3 = nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(
        self, x: torch.Tensor, cache: Optional[Tuple[torch.Tensor, torch.Tensor]]
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split(D, dim=-1)
        q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
        if cache is not None:  # the growing key/value cache
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, D))
        h = self.n2(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x, (k, v)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor, caches: Cache) -> Tuple[torch.Tensor, Cache]:
        x = self.emb(idx)
        new: Cache = []
        for layer, c in zip(self.layers, caches):
            x, kv = layer(x, c)
            new.append(kv)
        return self.head(self.norm(x)), new


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor) -> Tuple[List[int], List[List[int]], torch.Tensor]:
    """Greedy tokens, each step's top-5 ids, and the last step's logits (on the CPU)."""
    caches: Cache = [None] * L
    logits, caches = model(prompt, caches)
    tokens, top5 = [], []
    for _ in range(NEW):
        last = logits[:, -1]
        nxt = last.argmax(-1)
        top5.append(torch.topk(last, 5, -1).indices[0].cpu().tolist())
        tokens.append(int(nxt.item()))
        logits, caches = model(nxt.view(1, 1), caches)
    return tokens, top5, logits[:, -1].cpu()


def main() -> int:
    torch.manual_seed(0)
    cpu_model = GPT().eval()
    with torch.no_grad():  # larger weights than the default init, so that the logits spread out
        for p in cpu_model.parameters():
            p.mul_(2.0)
    prompt = torch.randint(0, V, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    want, want5, want_logits = generate(cpu_model, prompt)
    npu_model = GPT().eval()
    npu_model.load_state_dict(cpu_model.state_dict())
    npu_model = npu_model.to("npu")
    fails = 0

    def check(ok: bool, what: str, detail: str) -> None:
        nonlocal fails
        print(f"{'ok  ' if ok else 'FAIL'} {what:28s} {detail}", flush=True)
        fails += not ok

    try:
        got, got5, got_logits = generate(npu_model, prompt.to("npu"))
        again, _, again_logits = generate(npu_model, prompt.to("npu"))
    except Exception as e:
        check(False, "generate on npu", f"raised {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        return 1
    print(f"cpu tokens {want}", flush=True)
    print(f"npu tokens {got}", flush=True)
    check(got == want, "tokens equal the CPU's", f"{sum(a == b for a, b in zip(got, want))}/{NEW} equal")
    check(got5 == want5, "top-5 of every step", f"{sum(a == b for a, b in zip(got5, want5))}/{NEW} equal")
    scale = float(want_logits.abs().max())
    err = float((got_logits - want_logits).abs().max()) / scale
    check(err <= 1e-4, "last logits", f"max|err| / max|logit| {err:.3g}")
    same = again == got and torch.equal(again_logits.view(torch.int32), got_logits.view(torch.int32))
    check(same, "deterministic", "a second run gives the same tokens and logit bits")
    print(f"{fails} failures", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
