#!/usr/bin/env python
"""The bundled character model (flowvm/programs/charlm.py) trained side by side as a plain PyTorch loop, as a
program written by hand in elements (CALLs, a REPEAT, a SWITCH), as the ``@flowvm.program`` function the
bundle ships, and as that program optimized (``flowvm.optimize``: its forward pass and loss statements fused
into one step), in the fused step's eager form and in its compiled form.

Run from the repository root::

    python bench/bench_charlm.py            # the default shape, 60 iterations a round, 5 rounds (about 3 minutes)
    python bench/bench_charlm.py --quick    # a small shape, no compiled form (CI smoke test)

After one untimed round of each form (torch's first calls of each kernel), each round trains a fresh model
from the same seed in each form, in turn: the whole run, from building (and optimizing) the program to the last
evaluation, on one torch thread.  The four must give the same losses bit for bit (checked, not timed).
Reported: iterations a second of each form, the median of the rounds, and each form's ratio to plain.

Then (not with --quick) the fused step's compiled form against its eager form, side by side: each round runs
the optimized program in each form, timed from the second iteration on (the first runs the fused step once,
and a compiled round compiles it there, from torch's caches: the first, cold compile is reported apart).  The
compiled form's losses match to float rounding (the largest difference is reported).  Figures are reported,
never asserted.  JSON goes to bench/results/charlm.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flowvm  # noqa: E402

from flowvm import CALL, REPEAT, SEQ, SWITCH, Registers  # noqa: E402
from flowvm.programs import charlm  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "charlm.json"
NAMES = ("corpus", "iters", "batch_size", "block", "n_layer", "n_head", "n_embd", "lr", "min_lr", "warmup",
         "weight_decay", "clip", "eval_every", "eval_iters", "seed")


def plain(corpus, iters, batch_size, block, n_layer, n_head, n_embd, lr, min_lr, warmup, weight_decay, clip,
          eval_every, eval_iters, seed):
    """The loop as one writes it in PyTorch (charlm.train's body, undecorated)."""
    return charlm.train.function(corpus, iters, batch_size, block, n_layer, n_head, n_embd, lr, min_lr, warmup,
                                 weight_decay, clip, eval_every, eval_iters, seed)


def by_hand(corpus, iters, batch_size, block, n_layer, n_head, n_embd, lr, min_lr, warmup, weight_decay, clip,
            eval_every, eval_iters, seed):
    """The same run written as elements over registers: what the loop takes without @flowvm.program."""
    reg = Registers(losses=[], evals=[], val_loss=None, total=0.0)

    def setup():
        torch.manual_seed(seed)
        model = charlm.GPT(len(corpus.vocab), block, n_layer, n_head, n_embd)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        return model, opt, torch.Generator().manual_seed(seed)

    def set_lr(opt, it):
        for group in opt.param_groups:
            group["lr"] = charlm.lr_at(it, lr, min_lr, warmup, iters)

    def loss_of(logits, y):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def record(losses, loss):
        losses.append(loss.item())

    def evaluating(it):
        return (it + 1) % eval_every == 0 or it + 1 == iters

    @torch.no_grad()
    def eval_batch(model, gen, total):
        xv, yv = corpus.batch("val", batch_size, block, gen)
        return total + loss_of(model(xv), yv).item()

    def finish_eval(evals, it, total):
        evals.append((it + 1, total / eval_iters))
        return total / eval_iters

    evaluate = SEQ([
        CALL(lambda m: m.eval(), reg("model")),
        CALL(lambda: torch.Generator().manual_seed(seed + 1), store_to=reg("eval_gen")),
        CALL(float, 0, store_to=reg("total")),
        REPEAT(eval_iters, CALL(eval_batch, reg("model"), reg("eval_gen"), reg("total"), store_to=reg("total"))),
        CALL(finish_eval, reg("evals"), reg("it"), reg("total"), store_to=reg("val_loss")),
        CALL(lambda m: m.train(), reg("model")),
    ])
    step = SEQ([
        CALL(set_lr, reg("opt"), reg("it")),
        CALL(corpus.batch, "train", batch_size, block, reg("gen"), store_to=(reg("x"), reg("y"))),
        CALL(lambda m, x: m(x), reg("model"), reg("x"), store_to=reg("logits")),
        CALL(loss_of, reg("logits"), reg("y"), store_to=reg("loss")),
        CALL(lambda o: o.zero_grad(set_to_none=True), reg("opt")),
        CALL(torch.Tensor.backward, reg("loss")),
        CALL(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), clip), reg("model")),
        CALL(lambda o: o.step(), reg("opt")),
        CALL(record, reg("losses"), reg("loss")),
        SWITCH(CALL(evaluating, reg("it")), {True: evaluate}, default=SEQ([])),
    ])
    return SEQ([CALL(setup, store_to=(reg("model"), reg("opt"), reg("gen"))),
                REPEAT(iters, step, counter=reg("it")),
                CALL(lambda losses, evals, model: {"losses": losses, "evals": evals, "model": model},
                     reg("losses"), reg("evals"), reg("model"))])


def timed(fn) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _iteration(drv) -> int:
    it = drv.registers["it"]
    return it if isinstance(it, int) else -1


def after_first_iteration(form: str, a: dict) -> tuple[float, list]:
    """(seconds, losses) of an optimized run with its fused step in form, timed from the second iteration on:
    the first (untimed) runs the fused step once, which, compiled, waits for its compile."""
    options = {"fuse-torch": {"form": form, "background": False, "compile_in": "thread"}}
    drv = flowvm.optimize(charlm.train(*(a[n] for n in NAMES)), options=options).start()
    while not drv.done and _iteration(drv) < 1:
        drv.run(max_steps=1)
    t0 = time.perf_counter()
    out = drv.run()
    return time.perf_counter() - t0, out["losses"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape, no compiled form (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--iters", type=int, default=None, help="iterations a round (default 60, quick 6)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = dict(iters=args.iters or (6 if args.quick else 60), eval_every=3 if args.quick else 20,
                 eval_iters=2 if args.quick else 5)
    if args.quick:
        shape.update(n_layer=2, n_embd=32, block=32)
    rounds = args.rounds or (2 if args.quick else 5)
    prog = charlm.build(max_bytes=200_000, **shape)
    values = prog.start().registers
    a = {name: values[name] for name in NAMES}
    eager = {"fuse-torch": {"form": "eager"}}
    forms = {"plain": lambda: plain(**a), "elements": lambda: by_hand(**a).run(),
             "program": lambda: charlm.train(*(a[n] for n in NAMES)).run(),
             "fused, eager": lambda: flowvm.optimize(charlm.train(*(a[n] for n in NAMES)), options=eager).run()}
    times: dict[str, list[float]] = {k: [] for k in forms}
    losses = {}
    for fn in forms.values():  # warm-up, not timed: torch's first calls of each kernel, the lowering's compile
        fn()
    for _ in range(rounds):
        for name, fn in forms.items():
            seconds, out = timed(fn)
            times[name].append(seconds)
            losses[name] = out["losses"]
    same = all(v == losses["plain"] for v in losses.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: a["iters"] / v for k, v in med.items()}
    print(f"character GPT: {a['n_layer']} layers, n_embd {a['n_embd']}, block {a['block']}, batch {a['batch_size']}; "
          f"{a['iters']} iterations a round (an evaluation of {a['eval_iters']} batches every {a['eval_every']}), "
          f"{rounds} rounds, medians, 1 torch thread")
    print(f"{'form':16s} {'iterations/s':>13s} {'x plain':>8s}")
    for k in forms:
        print(f"{k:16s} {rate[k]:13.2f} {med[k] / med['plain']:8.3f}")
    print(f"the same losses in the four forms (bit for bit): {'yes' if same else 'NO'}")
    result = {"benchmark": "charlm", "quick": args.quick, "shape": {k: v for k, v in a.items() if k != "corpus"},
              "rounds": rounds, "torch": torch.__version__,
              "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                              "date": datetime.datetime.now().isoformat(timespec="seconds")},
              "seconds": times, "median_seconds": med, "iterations_per_second": rate,
              "ratio_to_plain": {k: med[k] / med["plain"] for k in med}, "same_losses": same}
    if not args.quick:  # (the CI smoke test leaves the compiles out)
        result["fused_step"] = compiled_against_eager(a, rounds, losses["plain"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0 if same else 1


def compiled_against_eager(a: dict, rounds: int, want: list) -> dict:
    """The fused step compiled against eager, side by side, from the second iteration on (each compiled round
    compiles its step again in its first iteration, from torch's caches: untimed)."""
    t0 = time.perf_counter()
    after_first_iteration("compiled", a)  # the cold compile, not timed by the rounds
    cold = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    differs = 0.0
    for _ in range(rounds):
        for form in times:
            seconds, losses = after_first_iteration(form, a)
            times[form].append(seconds)
            differs = max([differs] + [abs(x - y) for x, y in zip(losses, want)])
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: (a["iters"] - 1) / v for k, v in med.items()}
    print(f"the fused step (forward pass and loss), iterations 2 to {a['iters']}, {rounds} rounds, medians:")
    for k in times:
        print(f"{k:16s} {rate[k]:13.2f} {med[k] / med['eager']:8.3f}  (x eager)")
    print(f"the compiled form's losses differ from the eager ones by at most {differs:.2e}; its first, cold "
          f"compile took {cold:.1f} s with the run's first iteration")
    return {"seconds": times, "median_seconds": med, "iterations_per_second": rate,
            "ratio_to_eager": med["compiled"] / med["eager"], "loss_difference": differs, "cold_seconds": cold}


if __name__ == "__main__":
    sys.exit(main())
