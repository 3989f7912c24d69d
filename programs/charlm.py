"""A character-level GPT (nanoGPT's shape) trained on the Python standard library's own source, as plain Python.

The training loop is one function written as ordinary PyTorch, ``train``, turned into a resumable program by
``@flowvm.program``: its warm-up and cosine learning-rate schedule, gradient clipping, the AdamW step, the
running list of losses and an evaluation on held-out text every ``eval_every`` iterations (``model.eval()``,
``torch.no_grad()``, its own loop) are the Python lines you would write, and a run pauses, saves and resumes
bit for bit at any of them, in the middle of an evaluation too.

The corpus is the text of the standard library's ``.py`` files, read in sorted order up to ``max_bytes``, so
every machine has it without a download (``corpus=`` takes a folder or a file of your own instead; ``text=``
a string).  A corpus read from files is kept in a run by its SHA-256 digest, not its text: a resume reads the
files again and refuses a corpus that differs (the standard library of another Python, an edited folder),
naming both digests.  ``model(registers)`` gives the trained network; ``sample(registers, n)`` text from it.

    flowvm run charlm --set iters=600 --checkpoint lm.ckpt
    flowvm run charlm --set corpus=~/src/myproject --set n_layer=6
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

import flowvm
from flowvm.programs import check_options

SHOW = ["it", "loss", "val_loss", "lr_now"]


# ------------------------------------------------------------------------------------------------ the corpus
class CorpusChanged(ValueError):
    """A run's corpus read again, on resume, gives other text than the run trained on."""


def _read(spec: str, max_bytes: int) -> tuple[bytes, str]:
    """The corpus's bytes (at most max_bytes) and a description of where they came from."""
    if spec == "stdlib":
        root, name = Path(sysconfig.get_paths()["stdlib"]), "the standard library's .py files"
    else:
        root = Path(os.path.expanduser(spec))
        name = str(root)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    else:
        raise ValueError(f"charlm: corpus {spec!r} is no file or folder")
    out, size = [], 0
    for path in files:
        data = path.read_bytes()[: max_bytes - size]
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size < 1000:
        raise ValueError(f"charlm: corpus {spec!r} holds {size} bytes; it needs at least 1000")
    return b"".join(out), name


class Corpus:
    """The training text as byte ids with a train/validation split (the last tenth), and random batches of it.
    Read from files, it pickles as where it was read and its digest (``__reduce__``); given as text, as text."""

    def __init__(self, spec: str = "stdlib", max_bytes: int = 2_000_000, text: str | None = None):
        if text is not None:
            raw, self.source = text.encode(), "the text given"
            if len(raw) < 1000:
                raise ValueError(f"charlm: the text given holds {len(raw)} bytes; it needs at least 1000")
        else:
            if spec != "stdlib":  # a folder or file, kept by its absolute path (a resume may start elsewhere)
                spec = str(Path(os.path.expanduser(spec)).resolve())
            raw, self.source = _read(spec, max_bytes)
        self.spec, self.max_bytes, self.text = spec, max_bytes, text
        self.digest = hashlib.sha256(raw).hexdigest()
        self.vocab = sorted(set(raw))
        table = torch.zeros(256, dtype=torch.long)
        table[torch.tensor(self.vocab)] = torch.arange(len(self.vocab))
        ids = table[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
        cut = len(ids) * 9 // 10
        self.train, self.val = ids[:cut], ids[cut:]

    def __reduce__(self):
        if self.text is not None:
            return (Corpus, (self.spec, self.max_bytes, self.text))
        return (_reread, (self.spec, self.max_bytes, self.digest, self.source))

    def batch(self, split: str, batch_size: int, block: int, generator: torch.Generator):
        """(inputs, targets): batch_size windows of block ids from split, each target the next id."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - block - 1, (batch_size,), generator=generator)
        x = torch.stack([data[i: i + block] for i in starts.tolist()])
        y = torch.stack([data[i + 1: i + 1 + block] for i in starts.tolist()])
        return x, y

    def decode(self, ids) -> str:
        return bytes(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


def _reread(spec: str, max_bytes: int, digest: str, source: str) -> Corpus:
    corpus = Corpus(spec, max_bytes)
    if corpus.digest != digest:
        import platform

        raise CorpusChanged(
            f"charlm: the corpus differs from the one the run trained on: {source} ({max_bytes} bytes at most) "
            f"gave sha256 {digest[:16]}... then and give {corpus.digest[:16]}... under this Python "
            f"({platform.python_version()}); a resume needs the same text: resume under the Python (or with the "
            f"files) the run started with")
    return corpus


# ------------------------------------------------------------------------------------------------ the model
class Block(torch.nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = torch.nn.LayerNorm(n_embd), torch.nn.LayerNorm(n_embd)
        self.qkv, self.proj = torch.nn.Linear(n_embd, 3 * n_embd), torch.nn.Linear(n_embd, n_embd)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU(),
                                       torch.nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """Token and position embeddings, n_layer pre-norm transformer blocks, a final LayerNorm and a linear head
    giving each position's logits over the vocabulary."""

    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block = block
        self.tok, self.pos = torch.nn.Embedding(vocab, n_embd), torch.nn.Embedding(block, n_embd)
        self.blocks = torch.nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln, self.head = torch.nn.LayerNorm(n_embd), torch.nn.Linear(n_embd, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def lr_at(it: int, lr: float, min_lr: float, warmup: int, iters: int) -> float:
    """Linear warm-up over `warmup` iterations, then a cosine decay from lr to min_lr at the last one."""
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------ the loop
@flowvm.program
def train(corpus, iters, batch_size, block, n_layer, n_head, n_embd, lr, min_lr, warmup, weight_decay, clip,
          eval_every, eval_iters, seed):
    torch.manual_seed(seed)
    model = GPT(len(corpus.vocab), block, n_layer, n_head, n_embd)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    losses, evals = [], []
    val_loss = None
    for it in range(iters):
        lr_now = lr_at(it, lr, min_lr, warmup, iters)
        for group in opt.param_groups:
            group["lr"] = lr_now
        x, y = corpus.batch("train", batch_size, block, gen)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            model.eval()
            eval_gen = torch.Generator().manual_seed(seed + 1)  # the same held-out windows at every evaluation
            total = 0.0
            with torch.no_grad():
                for k in range(eval_iters):
                    xv, yv = corpus.batch("val", batch_size, block, eval_gen)
                    logits_v = model(xv)
                    total += F.cross_entropy(logits_v.view(-1, logits_v.size(-1)), yv.view(-1)).item()
            val_loss = total / eval_iters
            evals.append((it + 1, val_loss))
            model.train()
    return {"losses": losses, "evals": evals, "model": model}


def build(iters: int = 300, batch_size: int = 16, block: int = 64, n_layer: int = 4, n_head: int = 4,
          n_embd: int = 64, lr: float = 3e-3, min_lr: float = 3e-4, warmup: int = 30, weight_decay: float = 0.1,
          clip: float = 1.0, eval_every: int = 50, eval_iters: int = 10, seed: int = 0, corpus: str = "stdlib",
          max_bytes: int = 2_000_000, text: str | None = None):
    """Train the character model for `iters` iterations of `batch_size` windows of `block` characters: AdamW,
    warm-up over `warmup` iterations then a cosine decay from lr to min_lr, gradients clipped to norm `clip`;
    the held-out loss over `eval_iters` batches every `eval_every` iterations and at the end."""
    check_options("charlm", counts=dict(iters=iters, batch_size=batch_size, block=block, n_layer=n_layer,
                                        n_head=n_head, n_embd=n_embd, eval_every=eval_every,
                                        eval_iters=eval_iters, max_bytes=max_bytes),
                  positive=dict(lr=lr, min_lr=min_lr, clip=clip))
    if n_embd % n_head:
        raise ValueError(f"charlm: n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    if warmup < 0 or isinstance(warmup, bool) or not isinstance(warmup, int):
        raise ValueError(f"charlm: warmup must be an int >= 0, got {warmup!r}")
    data = Corpus(corpus, max_bytes, text)
    if len(data.val) <= block + 1:
        raise ValueError(f"charlm: the corpus's held-out tenth ({len(data.val)} characters) is shorter than a "
                         f"window of block={block}")
    return train(data, iters, batch_size, block, n_layer, n_head, n_embd, lr, min_lr, warmup, weight_decay, clip,
                 eval_every, eval_iters, seed)


def model(registers) -> GPT:
    """The trained network of a run (a ``GPT``, in eval mode)."""
    return registers["model"].eval()


@torch.no_grad()
def sample(registers, n: int = 200, seed: int = 0, temperature: float = 0.8) -> str:
    """n characters drawn from the trained model, starting from a newline."""
    net, corpus = registers["model"], registers["corpus"]
    was = net.training
    net.eval()
    gen = torch.Generator().manual_seed(seed)
    start = corpus.vocab.index(ord("\n")) if ord("\n") in corpus.vocab else 0
    idx = torch.tensor([[start]])
    for _ in range(n):
        logits = net(idx[:, -net.block:])[:, -1, :] / temperature
        idx = torch.cat([idx, torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)], dim=1)
    net.train(was)
    return corpus.decode(idx[0, 1:].tolist())


def report(registers) -> str:
    losses, evals, corpus = registers["losses"], registers["evals"], registers["corpus"]
    lines = [f"character GPT on {corpus.source} ({len(corpus.train) + len(corpus.val)} characters, "
             f"{len(corpus.vocab)} distinct; sha256 {corpus.digest[:16]}...): {len(losses)} iterations, "
             f"training loss {losses[0]:.3f} -> {losses[-1]:.3f}",
             f"{'iteration':>10} {'held-out loss':>14}"]
    lines += [f"{it:>10} {value:>14.4f}" for it, value in evals]
    lines += ["a sample:", sample(registers, 120)]
    return "\n".join(lines)
