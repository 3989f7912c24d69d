"""A nanoGPT-style character model trained by a program whose step (zero_grad, forward, cross_entropy,
backward) is one fused step compiled in the background on the compile thread, while the program goes on
eagerly; run as a script by tests/fused/test_thread_compile_gpt.py, it prints one JSON line."""

from __future__ import annotations

import faulthandler
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import flowvm
from flowvm import CALL, REPEAT, SEQ, Registers
from flowvm.passes.fuse_torch import fuse_torch

faulthandler.enable()
FORM = "compiled"
VOCAB, BLOCK, EMBED, HEADS, LAYERS, BATCH = 64, 32, 64, 4, 2, 8


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(EMBED, 3 * EMBED)
        self.proj = torch.nn.Linear(EMBED, EMBED)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(EMBED, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).tril().logical_not(), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(EMBED), torch.nn.LayerNorm(EMBED)
        self.attn = Attention()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBED, 4 * EMBED), torch.nn.GELU(),
                                       torch.nn.Linear(4 * EMBED, EMBED))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, EMBED), torch.nn.Embedding(BLOCK, EMBED)
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = torch.nn.LayerNorm(EMBED)
        self.head = torch.nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


@flowvm.fusable
def loss_of(logits, y):
    return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def main(after: int, wait: float) -> dict:
    """Train until the background compile is over (at most wait seconds) and then ``after`` iterations more;
    then the same number of iterations of a plain PyTorch loop from the same start."""
    from flowvm import INCOMPLETE

    torch.manual_seed(0)
    text = torch.randint(0, VOCAB, (4096,))
    x = torch.stack([text[i:i + BLOCK] for i in range(0, BATCH * BLOCK, BLOCK)])
    y = torch.stack([text[i + 1:i + 1 + BLOCK] for i in range(0, BATCH * BLOCK, BLOCK)])
    torch.manual_seed(1)
    model = GPT()
    torch.manual_seed(1)
    ref = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    reg = Registers(x=x, y=y)
    body = SEQ([CALL(opt.zero_grad), CALL(model, reg("x"), store_to=reg("logits")),
                CALL(loss_of, reg("logits"), reg("y"), store_to=reg("loss")),
                CALL(torch.Tensor.backward, reg("loss")), CALL(opt.step)])
    fast = fuse_torch(REPEAT(10 ** 9, body), compile_after=0, payback=0, form=FORM, background=True,
                      compile_in="thread")
    where, fused = next((path, e) for path, e in fast.walk() if type(e).__name__ == "FUSED")
    rt = fused.runtime()
    drv = fast.start()
    start = time.time()
    while rt.state in ("new", "compiling") and time.time() - start < wait:
        drv.run(max_steps=15)  # five iterations at a time: the compile's tracing meets the program's steps
        time.sleep(0.01)
    compiled_at = int(opt.state[model.head.weight]["step"])
    drv.run(max_steps=3 * after)
    while drv.position != ".".join(map(str, where)):  # up to the end of an iteration
        drv.run(max_steps=1)
    iterations = int(opt.state[model.head.weight]["step"])
    for _ in range(iterations):
        ref_opt.zero_grad()
        loss_of(ref(x), y).backward()
        ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"hits": rt.hits, "state": rt.state, "refused": rt.refused, "header": fused.header_text(),
            "calls": len(fused.calls), "iterations": iterations, "compiled_at": compiled_at, "max_diff": diff,
            "loss": float(reg["loss"].detach()), "seconds": time.time() - start}


if __name__ == "__main__":
    FORM = sys.argv[3] if len(sys.argv) > 3 else FORM
    print(json.dumps(main(int(sys.argv[1]), float(sys.argv[2]))), flush=True)
