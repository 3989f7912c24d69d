"""Full-batch L-BFGS (torch.optim.LBFGS with a closure) until the gradient vanishes or the loss stops changing.

Each step is one L-BFGS iteration: ``optimizer.step(closure)`` (torch.optim.LBFGS) with
``max_iter=1``, where the closure re-evaluates the loss and its gradient as
often as the strong-Wolfe line search asks.  A WHILE repeats it until the
largest gradient component is at most ``tol``, the loss changed by no more
than ``tolerance_change`` (relative to its size) in the last iteration, or
``max_iter`` iterations have run: a loop with no epochs or batches, which
epoch/batch training frameworks fit badly.  The optimizer's curvature history
lives in its state, so a run stopped between two iterations resumes exactly.

The function minimized is the user's ``objective`` (a Python callable, or
``"module:function"`` on the command line, imported when the program is
built): a function of a 1-d float64 tensor of ``dim`` parameters returning a
scalar loss tensor, computed with torch operations (autograd gives the
gradient); it starts from ``x0`` (zeros unless given).  Without one, a
built-in ``problem`` with a known optimum:

- ``rosenbrock``: the n-dimensional Rosenbrock function from the classic
  start (-1.2, 1, -1.2, 1, ...); the minimum is 0 at (1, ..., 1);
- ``least_squares``: mean squared residual of a random overdetermined
  linear system; the minimum is numpy's ``lstsq`` solution.

``model(registers)`` gives the result: the solution ``x_``, ``loss_``,
``grad_norm_``, ``n_iter_``, ``n_evaluations_`` and why it stopped
(``stop_reason``, and ``status_``: its index in ``STOP_REASONS``).

    flowvm run lbfgs --set problem=least_squares
    flowvm run lbfgs --set objective=my_losses:logistic --set dim=31 --output fit.npz
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from flowvm import CALL, SEQ, WHILE, Registers
from flowvm.programs import check_options

SHOW = ["loss", "grad_norm"]
THREADS = 1  # these small problems run fastest on one torch thread; build() declares it
PROBLEMS = ("rosenbrock", "least_squares")
STOP_REASONS = ("gradient below tol", "loss stopped changing", "max_iter reached")


class Objective:
    """A differentiable function of one float64 parameter vector; calling it is the L-BFGS closure."""

    def __init__(self, x0: np.ndarray):
        self.x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
        self.evaluations = 0

    def loss(self) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self) -> torch.Tensor:
        """The closure: zero the gradient, evaluate the loss, backpropagate."""
        self.evaluations += 1
        self.x.grad = None
        value = self.loss()
        value.backward()
        return value

    def value(self) -> float:
        with torch.no_grad():
            return self.loss().item()

    def grad_norm(self) -> float:
        """The largest absolute gradient component at the current point (what LBFGS's tolerance_grad tests)."""
        x = self.x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.loss_at(x), x)
        return grad.abs().max().item()

    def loss_at(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def solution(self) -> np.ndarray:
        return self.x.detach().numpy().copy()

    def state_dict(self) -> dict:
        """The point, its gradient (None when unset) and the evaluation count; the problem is rebuilt by
        build()."""
        grad = self.x.grad
        return {"x": self.x.detach().clone(), "grad": None if grad is None else grad.clone(),
                "evaluations": self.evaluations}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.x.copy_(state["x"])  # in place: the optimizer holds this tensor
        grad = state["grad"]
        self.x.grad = None if grad is None else grad.to(dtype=self.x.dtype).clone()
        self.evaluations = int(state["evaluations"])


class Rosenbrock(Objective):
    """sum 100 (x[i+1] - x[i]^2)^2 + (1 - x[i])^2; minimum 0 at all ones."""

    def __init__(self, dim: int = 10):
        if dim < 2:
            raise ValueError(f"lbfgs: the Rosenbrock function needs dim >= 2, got {dim}")
        super().__init__(np.resize([-1.2, 1.0], dim))
        self.optimum = np.ones(dim)

    def loss_at(self, x):
        return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()

    def loss(self):
        return self.loss_at(self.x)


class LeastSquares(Objective):
    """mean (A x - b)^2 for a random rows x dim system; minimum at lstsq(A, b)."""

    def __init__(self, dim: int = 10, rows: int = 200, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.standard_normal((rows, dim))
        self.b = self.a @ rng.standard_normal(dim) + 0.1 * rng.standard_normal(rows)
        self._a, self._b = torch.from_numpy(self.a), torch.from_numpy(self.b)
        super().__init__(np.zeros(dim))
        self.optimum = np.linalg.lstsq(self.a, self.b, rcond=None)[0]

    def loss_at(self, x):
        return ((self._a @ x - self._b) ** 2).mean()

    def loss(self):
        return self.loss_at(self.x)


class UserObjective(Objective):
    """The user's function of the parameter vector (a 1-d float64 tensor) returning a scalar loss tensor."""

    def __init__(self, fn, x0: np.ndarray, name: str):
        self.fn = fn
        self.name = name
        self.optimum = None  # not known
        super().__init__(x0)

    def loss_at(self, x):
        return self.fn(x).reshape(())

    def loss(self):
        return self.loss_at(self.x)


def resolve(objective) -> tuple:
    """(the function, its name) of an objective given as a callable or as "module:function"."""
    if callable(objective):
        return objective, getattr(objective, "__qualname__", None) or type(objective).__name__
    if not isinstance(objective, str):
        raise TypeError(f"lbfgs: objective must be a function of a parameter tensor or 'module:function', got "
                        f"{type(objective).__name__} {objective!r:.60}")
    module_name, sep, attr = objective.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"lbfgs: objective {objective!r}: give 'module:function' (a module Python can import: "
                         "on sys.path, e.g. through PYTHONPATH, and a function in it)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"lbfgs: objective {objective!r}: cannot import module {module_name!r} "
                         f"({type(err).__name__}: {err}); it must be importable (on sys.path: for a file in the "
                         "current folder, set PYTHONPATH=.)") from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"lbfgs: objective {objective!r}: {module_name} ({getattr(module, '__file__', '?')}) "
                             f"has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"lbfgs: objective {objective!r} is a {type(fn).__name__}, not a function")
    return fn, objective


def user_objective(objective, dim: int, x0) -> UserObjective:
    """The user's objective, checked at its start: a differentiable, finite scalar of a dim-vector."""
    fn, name = resolve(objective)
    start = np.zeros(dim) if x0 is None else np.asarray(x0, dtype=np.float64).reshape(-1)
    if len(start) != dim:
        raise ValueError(f"lbfgs: x0 has {len(start)} values but dim={dim}")
    if not np.isfinite(start).all():
        raise ValueError(f"lbfgs: x0 holds {start[~np.isfinite(start)][0]}; the start must be finite")
    x = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    try:
        value = fn(x)
    except Exception as err:
        raise ValueError(f"lbfgs: objective {name} raised {type(err).__name__} at the start (a float64 tensor of "
                         f"{dim} values): {err}") from err
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"lbfgs: objective {name} returned {what}; it must return a scalar float tensor "
                         "computed from its argument with torch operations")
    if not value.requires_grad:
        raise ValueError(f"lbfgs: objective {name} returned a value that does not depend on its argument "
                         "through torch operations (no gradient): compute the loss with torch, not numpy or .item()")
    if not torch.isfinite(value).all():
        raise ValueError(f"lbfgs: objective {name} is {value.item()} at the start; it must be finite there")
    return UserObjective(fn, start, name)


class Stopping:
    """Keep iterating while the gradient is above tol, the loss still changes by more than tolerance_change
    (relative: |previous - loss| > tolerance_change * max(|previous|, |loss|)) and fewer than max_iter L-BFGS
    iterations ran; ``reason`` says which ended the run."""

    tolerance_change = 0.0  # what runs saved before there was a tolerance_change (and a reason) go on with
    previous = None
    reason = None

    def __init__(self, optimizer: torch.optim.LBFGS, tol: float, max_iter: int, tolerance_change: float = 0.0):
        self.optimizer = optimizer
        self.tol = tol
        self.max_iter = max_iter
        self.tolerance_change = tolerance_change
        self.previous = None  # the loss when the last iteration began
        self.reason = None

    def iterations(self) -> int:
        param = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state[param].get("n_iter", 0))

    def keep_going(self, grad_norm: float, loss: float | None = None) -> bool:
        if grad_norm <= self.tol:
            self.reason = STOP_REASONS[0]
        elif loss is not None and self.previous is not None \
                and abs(self.previous - loss) <= self.tolerance_change * max(abs(self.previous), abs(loss)):
            self.reason = STOP_REASONS[1]
        elif self.iterations() >= self.max_iter:
            self.reason = STOP_REASONS[2]
        elif grad_norm != grad_norm:  # NaN: no comparison above holds
            raise FloatingPointError(f"lbfgs: the gradient is NaN after {self.iterations()} iterations "
                                     f"(loss {loss})")
        else:
            self.previous = loss
            return True
        return False

    def result(self, x: np.ndarray, loss: float, grad_norm: float) -> "LBFGSResult":
        param = self.optimizer.param_groups[0]["params"][0]
        evaluations = int(self.optimizer.state[param].get("func_evals", 0))
        return LBFGSResult(x, loss, grad_norm, self.iterations(), evaluations, self.reason)

    def state_dict(self) -> dict:
        """The optimizer's state dict, the loss the current iteration began at and why the run stopped (tol,
        tolerance_change and max_iter are settings)."""
        return {"optimizer": self.optimizer.state_dict(), "previous": self.previous, "reason": self.reason}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.previous = state.get("previous")
        self.reason = state.get("reason")


class LBFGSResult:
    """What a finished L-BFGS run found: the solution ``x_``, its ``loss_``, the largest gradient component
    ``grad_norm_`` there, ``n_iter_`` iterations, ``n_evaluations_`` evaluations of the loss and gradient by
    the optimizer, and why it stopped: ``stop_reason`` (one of ``STOP_REASONS``) and ``status_`` (its index)."""

    def __init__(self, x, loss: float, grad_norm: float, iterations: int, evaluations: int, reason: str):
        self.x_ = np.asarray(x, dtype=np.float64)
        self.loss_ = float(loss)
        self.grad_norm_ = float(grad_norm)
        self.n_iter_ = int(iterations)
        self.n_evaluations_ = int(evaluations)
        self.stop_reason = str(reason)
        self.status_ = STOP_REASONS.index(reason)

    @property
    def converged(self) -> bool:
        """Whether the gradient reached the tolerance (rather than the loss stalling or max_iter)."""
        return self.status_ == 0


def make_problem(problem: str, dim: int, seed: int) -> Objective:
    if problem == "rosenbrock":
        return Rosenbrock(dim)
    if problem == "least_squares":
        return LeastSquares(dim, seed=seed)
    raise ValueError(f"lbfgs: unknown problem {problem!r}; choose one of {', '.join(PROBLEMS)}")


def build(problem: str = "rosenbrock", dim: int = 10, tol: float = 1e-8, max_iter: int = 500,
          history_size: int = 10, seed: int = 0, objective=None, x0=None, tolerance_change: float = 1e-15):
    """Minimize objective (a function of a dim-vector, or 'module:function'), else the built-in `problem`, in
    `dim` dimensions with L-BFGS (strong-Wolfe line search) until max |grad| <= tol, the loss changes by at most
    tolerance_change (relative) in an iteration, or max_iter iterations."""
    check_options("lbfgs", counts=dict(dim=dim, max_iter=max_iter, history_size=history_size))
    for name, value in (("tol", tol), ("tolerance_change", tolerance_change)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"lbfgs: {name} must be a number >= 0, got {value!r}")
    if objective is not None:
        if problem != "rosenbrock":
            raise ValueError(f"lbfgs: give objective= or problem=, not both (problem={problem!r})")
        target = user_objective(objective, dim, x0)
    else:
        if x0 is not None:
            raise ValueError("lbfgs: x0 is the start of a user objective; the built-in problems have their own")
        target = make_problem(problem, dim, seed)
    optimizer = torch.optim.LBFGS([target.x], lr=1, max_iter=1, max_eval=25, history_size=history_size,
                                  tolerance_grad=tol, tolerance_change=0.0, line_search_fn="strong_wolfe")
    stopping = Stopping(optimizer, tol, max_iter, tolerance_change)
    reg = Registers(optimum=target.optimum)
    return SEQ([
        CALL(target.value, store_to=reg("loss")),
        CALL(target.grad_norm, store_to=reg("grad_norm")),
        WHILE(CALL(stopping.keep_going, reg("grad_norm"), reg("loss")), SEQ([
            CALL(optimizer.step, target),
            CALL(target.value, store_to=reg("loss")),
            CALL(target.grad_norm, store_to=reg("grad_norm")),
        ])),
        CALL(stopping.iterations, store_to=reg("iterations")),
        CALL(target.solution, store_to=reg("x")),
        CALL(stopping.result, reg("x"), reg("loss"), reg("grad_norm"), store_to=reg("model")),
    ]).with_process_settings({"torch.threads": THREADS})


def model(registers) -> LBFGSResult:
    """The result of a finished run: solution, loss, gradient norm, iterations and why it stopped."""
    return registers["model"]


def report(registers) -> str:
    fit = registers.get("model")
    lines = [f"L-BFGS: {registers['iterations']} iterations, loss {registers['loss']:.3e}, "
             f"max |gradient| {registers['grad_norm']:.3e}" + (f"; stopped: {fit.stop_reason}" if fit else "")]
    if registers["optimum"] is not None:
        error = np.abs(registers["x"] - registers["optimum"]).max()
        lines.append(f"largest distance to the known optimum (one coordinate): {error:.3e}")
    return "\n".join(lines)
