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
    flowvm run sweep --data iris.csv --set label=species --set val_fraction=0.25

With ``data`` (and the mlp program's ``label`` and ``val_fraction``), every trial trains on it instead of the
spirals.  ``search`` (below, and ``flowvm sweep``) searches over any program's options.
"""

from __future__ import annotations

import math

import numpy as np

from flowvm import CALL, SEQ, SPAWN, WEAVE, Registers
from flowvm.programs import check_options

SHOW = ["best_accuracy"]


def draw_configs(trials: int, epochs: int, samples: int, seed: int, data: dict | None = None) -> list[dict]:
    """Random-search configurations, alternating Adam and SGD; data: the mlp options that choose the data
    (``data``, ``label``, ``val_fraction``), the same in every trial (then samples is not used)."""
    rng = np.random.default_rng(seed)
    configs = []
    for i in range(trials):
        optimizer = ("adam", "sgd")[i % 2]
        low, high = (1e-3, 3e-2) if optimizer == "adam" else (1e-2, 3e-1)
        lr = float(math.exp(rng.uniform(math.log(low), math.log(high))))
        hidden = int(rng.choice([16, 32, 64]))
        configs.append({"optimizer": optimizer, "lr": round(lr, 5), "hidden": hidden, "epochs": epochs,
                        **(data if data else {"samples": samples}), "seed": seed})
    return configs


def run_trial(config: dict) -> dict:
    """Train the mlp program with config to the end (on one torch thread); its accuracy, loss and weights."""
    import torch

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


def build(trials: int = 4, epochs: int = 5, samples: int = 3000, executor: str | None = None, seed: int = 0,
          data=None, label=None, val_fraction=None, drop=None):
    """Random search over `trials` MLP configurations trained for `epochs` epochs, all trials in parallel, on
    spirals or on data (the mlp program's data, label and val_fraction options, given to every trial)."""
    check_options("sweep", counts=dict(trials=trials, epochs=epochs, samples=samples))
    import torch  # noqa: F401  (the trials train torch models: without torch the program is refused at once)

    chosen = None
    if data is not None:
        from flowvm.programs import mlp

        mlp.build(epochs=1, data=data, label=label, val_fraction=val_fraction, drop=drop)  # bad data: refused now
        chosen = {"data": data, "label": label, "val_fraction": val_fraction}
        if drop is not None:
            chosen["drop"] = drop
    configs = draw_configs(trials, epochs, samples, seed, chosen)
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


# ------------------------------------------------------------------ a search over any program's options
def parse_space(specs: "list[str] | dict") -> dict:
    """Search dimensions from ``name=kind:args`` texts (``--space`` on the command line): ``loguniform:LOW:HIGH``,
    ``uniform:LOW:HIGH``, ``int:LOW:HIGH`` (both ends included) or ``choice:A,B,C`` (Python literals, else
    text).  A dict of such texts, or of already parsed ``(kind, args)``, is taken as it is."""
    items = specs.items() if isinstance(specs, dict) else [s.partition("=")[::2] for s in specs]
    return {name: tuple(spec) if not isinstance(spec, str) else _dimension(name, spec) for name, spec in items}


def _dimension(name: str, spec: str) -> tuple:
    """(kind, args) of one ``name=kind:args`` text."""
    import ast

    kind, _, rest = spec.partition(":")
    if not name.isidentifier() or not rest:
        raise ValueError(f"sweep: a search dimension is name=kind:args, got {name}={spec!r}")
    if kind == "choice":
        values = []
        for text in rest.split(","):
            try:
                values.append(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                values.append(text)
        return ("choice", values)
    if kind not in ("uniform", "loguniform", "int"):
        raise ValueError(f"sweep: {name}={spec}: unknown kind {kind!r} (uniform, loguniform, int, choice)")
    try:
        low, high = (float(v) for v in rest.split(":"))
    except ValueError:
        raise ValueError(f"sweep: {name}={spec}: {kind} needs LOW:HIGH numbers") from None
    if not low < high or (kind == "loguniform" and low <= 0):
        raise ValueError(f"sweep: {name}={spec}: needs LOW < HIGH" + (" and LOW > 0" if kind == "loguniform" else ""))
    return (kind, [low, high])


def draw(space: dict, trials: int, seed: int) -> list[dict]:
    """``trials`` configurations drawn from space by a seeded generator (the same draws on every run)."""
    rng = np.random.default_rng(seed)
    configs = []
    for _ in range(trials):
        config = {}
        for name, (kind, args) in space.items():
            if kind == "choice":
                value = args[int(rng.integers(len(args)))]
            elif kind == "int":
                value = int(rng.integers(int(args[0]), int(args[1]) + 1))
            elif kind == "uniform":
                value = float(rng.uniform(args[0], args[1]))
            else:
                value = float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
            config[name] = value
        configs.append(config)
    return configs


class Trial:
    """One trial of a search: the program module ``target`` (a bundled name or a module name) built with the
    fixed options and a configuration, run to its end; its metric register, the fitted model (its module's
    ``model(registers)``, when there is one) and the step count.

    It holds the module's ``build`` and ``model`` functions themselves, not the module's name: a trial sent to
    a worker that cannot import the module (a program file on this machine only) takes them along by value
    (see flowvm.processes.shipping), those of an installed module by reference."""

    def __init__(self, target: str, fixed: dict, metric: str):
        self.target, self.fixed, self.metric = target, dict(fixed), metric
        module = self.module()
        self.build, self.model = module.build, getattr(module, "model", None)
        self.threads = getattr(module, "THREADS", None)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "build" not in state:  # a trial saved by flowvm 0.2.0 names its module only
            module = self.module()
            self.build, self.model = module.build, getattr(module, "model", None)
            self.threads = getattr(module, "THREADS", None)

    def module(self):
        import importlib

        try:
            return importlib.import_module(f"flowvm.programs.{self.target}")
        except ModuleNotFoundError:
            return importlib.import_module(self.target)

    def __call__(self, config: dict) -> dict:
        threads = self.threads
        if threads is not None:  # a torch program: its thread count for the trial
            import torch

            before = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            drv = self.build(**self.fixed, **config).start()
            drv.run()
        finally:
            if threads is not None:
                torch.set_num_threads(before)
        regs = drv.registers
        if self.metric not in regs:
            raise KeyError(f"sweep: the trial's program has no register {self.metric!r} to rank trials by "
                           f"(registers: {', '.join(sorted(regs))})")
        value = regs[self.metric]
        value = float(value.item() if hasattr(value, "item") else value)
        model = self.model(regs) if callable(self.model) else None
        return {"config": config, "metric": value, "model": model, "steps": drv.steps}


def best_trial(results: list[dict], minimize: bool) -> dict:
    """The trial with the best metric (the first among equals); NaN ranks last."""
    def key(i):
        m = results[i]["metric"]
        return (m != m, m if minimize else -m, i)
    k = min(range(len(results)), key=key)
    return dict(results[k], trial=k)


def metric_of(result: dict) -> float:
    return result["metric"]


def search(target: str, space: "dict | list[str]", trials: int = 8, metric: str = "accuracy", minimize: bool = False,
           fixed: dict | None = None, executor: str | None = None, seed: int = 0):
    """Random search over the options of any program module with ``build(**options)``: ``trials``
    configurations drawn from ``space`` (see parse_space), each trained to its end in a SPAWN (all woven, so
    they run in parallel on the executor), ranked by the register ``metric`` (highest first, or lowest with
    ``minimize``); the best trial (its configuration, metric and fitted model) ends in register ``best``."""
    check_options("sweep", counts=dict(trials=trials))
    space = parse_space(space)
    fixed = dict(fixed or {})
    clash = sorted(set(space) & set(fixed))
    if clash:
        raise ValueError(f"sweep: {', '.join(clash)} both searched and fixed")
    trial = Trial(target, fixed, metric)  # refused here, not in a worker, when the module cannot be imported
    import inspect

    options = inspect.signature(trial.build).parameters
    unknown = [n for n in list(space) + list(fixed) if n not in options
               and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in options.values())]
    if unknown:
        raise ValueError(f"sweep: {target}'s build() has no option {unknown[0]!r}; options: {', '.join(options)}")
    configs = draw(space, trials, seed)
    reg = Registers({f"config_{i}": c for i, c in enumerate(configs)})
    results = [reg(f"trial_{i}") for i in range(trials)]
    return SEQ([
        WEAVE(-1, [SPAWN(CALL(trial, reg(f"config_{i}"), store_to=results[i]), executor=executor)
                   for i in range(trials)]),
        CALL(best_trial, results, minimize, store_to=reg("best")),
        CALL(metric_of, reg("best"), store_to=reg("best_metric")),
    ])


def model(registers):
    """The best trial's fitted model: its program's ``model(registers)`` (a search), or the best MLP as a
    ``torch.nn.Module`` with ``predict`` and ``predict_proba`` (the built-in sweep)."""
    best = registers["best"]
    fitted = best.get("model")
    if fitted is None and "weights" in best:  # the built-in sweep's trials keep their MLP's weights
        import torch

        from flowvm.programs import mlp

        weights = best["weights"]  # [W0, b0, W1, b1, ...], Wi: outputs x inputs
        network = mlp.Classifier([weights[0].shape[1]] + [w.shape[0] for w in weights[0::2]])
        with torch.no_grad():
            for parameter, value in zip(network.parameters(), weights):
                parameter.copy_(value)
        return network.eval()
    return fitted


def search_report(registers) -> str:
    best = registers["best"]
    trials = sorted((k for k in registers if k.startswith("trial_")), key=lambda k: int(k.split("_")[1]))
    names = list(registers["trial_0"]["config"]) if trials else []
    lines = [f"search of {len(trials)} trials; best: trial {best['trial']} with {best['metric']:.6g}",
             " ".join(f"{h:>12}" for h in ["trial", *names, "metric"])]
    for name in trials:
        r = registers[name]
        cells = [name.split("_")[1], *(f"{r['config'][n]:.5g}" if isinstance(r["config"][n], float)
                                       else str(r["config"][n]) for n in names), f"{r['metric']:.6g}"]
        lines.append(" ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)
