"""A hyper-parameter sweep: MLP trials run in parallel with SPAWN, and the best one is kept.

The build draws `trials` configurations (optimizer, learning rate on a log
scale, hidden width) from a seeded generator into registers ``config_0``,
``config_1``, ...  A WEAVE of SPAWNs runs every trial in a worker process
at the same time (the default pool has one worker per core; pass the name
of an executor registered with ``flowvm.register_executor`` to
use another, a Dask cluster for example).  Each trial trains the ``mlp``
program to the end and sends back its held-out accuracy, final loss and
weights; a last CALL keeps the best.  A run saved while trials are in
flight submits them again when resumed: trials are deterministic, so the
registers come out the same.

    flowvm run sweep --set trials=6 --set epochs=8
"""

from __future__ import annotations

import math

import numpy as np
import torch  # the trials train torch models: without torch the program is refused at once

from flowvm import CALL, SEQ, SPAWN, WEAVE, Registers
from flowvm.programs import check_options

SHOW = ["best_accuracy"]


def draw_configs(trials: int, epochs: int, samples: int, seed: int) -> list[dict]:
    """Random-search configurations, alternating Adam and SGD."""
    rng = np.random.default_rng(seed)
    configs = []
    for i in range(trials):
        optimizer = ("adam", "sgd")[i % 2]
        low, high = (1e-3, 3e-2) if optimizer == "adam" else (1e-2, 3e-1)
        lr = float(math.exp(rng.uniform(math.log(low), math.log(high))))
        hidden = int(rng.choice([16, 32, 64]))
        configs.append({"optimizer": optimizer, "lr": round(lr, 5), "hidden": hidden, "epochs": epochs,
                        "samples": samples, "seed": seed})
    return configs


def run_trial(config: dict) -> dict:
    """Train the mlp program with config to the end (on one torch thread); its accuracy, loss and weights."""
    from flowvm.programs import mlp

    threads = torch.get_num_threads()
    torch.set_num_threads(mlp.THREADS)
    try:
        drv = mlp.build(**config).start()
        drv.run()
    finally:
        torch.set_num_threads(threads)
    regs = drv.registers
    return {"config": config, "accuracy": regs["accuracy"], "loss": regs["loss"], "weights": regs["weights"],
            "steps": drv.steps}


def best_of(results: list[dict]) -> dict:
    """The trial with the highest accuracy (then the lowest final loss, then the first)."""
    order = sorted(range(len(results)), key=lambda i: (-results[i]["accuracy"], results[i]["loss"], i))
    return dict(results[order[0]], trial=order[0])


def accuracy_of(result: dict) -> float:
    return result["accuracy"]


def build(trials: int = 4, epochs: int = 5, samples: int = 3000, executor: str | None = None, seed: int = 0):
    """Random search over `trials` MLP configurations trained for `epochs` epochs, all trials in parallel."""
    check_options("sweep", counts=dict(trials=trials, epochs=epochs, samples=samples))
    configs = draw_configs(trials, epochs, samples, seed)
    reg = Registers({f"config_{i}": c for i, c in enumerate(configs)})
    results = [reg(f"trial_{i}") for i in range(trials)]
    return SEQ([
        WEAVE(-1, [SPAWN(CALL(run_trial, reg(f"config_{i}"), store_to=results[i]), executor=executor)
                   for i in range(trials)]),
        CALL(best_of, results, store_to=reg("best")),
        CALL(accuracy_of, reg("best"), store_to=reg("best_accuracy")),
    ])


def report(registers) -> str:
    trials = sorted(k for k in registers if k.startswith("trial_"))
    lines = [f"sweep of {len(trials)} MLP trials; best: trial {registers['best']['trial']} with held-out "
             f"accuracy {registers['best_accuracy']:.4f}",
             f"{'trial':>5} {'optimizer':>9} {'lr':>8} {'hidden':>6} {'accuracy':>9} {'loss':>9}"]
    for name in sorted(trials, key=lambda k: int(k.split("_")[1])):
        r = registers[name]
        c = r["config"]
        lines.append(f"{name.split('_')[1]:>5} {c['optimizer']:>9} {c['lr']:>8.5f} {c['hidden']:>6} "
                     f"{r['accuracy']:>9.4f} {r['loss']:>9.5f}")
    return "\n".join(lines)
