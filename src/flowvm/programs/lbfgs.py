"""Full-batch L-BFGS (torch.optim.LBFGS with a closure) until the gradient vanishes.

Each step is one L-BFGS iteration: ``optimizer.step(closure)`` (torch.optim.LBFGS) with
``max_iter=1``, where the closure re-evaluates the loss and its gradient as
often as the strong-Wolfe line search asks.  A WHILE repeats it until the
largest gradient component is below ``tol`` or ``max_iter`` iterations have
run: a loop with no epochs or batches, which epoch/batch training frameworks
fit badly.  The optimizer's curvature history lives in its state, so a run
stopped between two iterations resumes exactly.

Problems with a known optimum:

- ``rosenbrock``: the n-dimensional Rosenbrock function from the classic
  start (-1.2, 1, -1.2, 1, ...); the minimum is 0 at (1, ..., 1);
- ``least_squares``: mean squared residual of a random overdetermined
  linear system; the minimum is numpy's ``lstsq`` solution.

    flowvm run lbfgs --set problem=least_squares
"""

from __future__ import annotations

import numpy as np
import torch

from flowvm import CALL, SEQ, WHILE, Registers
from flowvm.programs import check_options

SHOW = ["loss", "grad_norm"]
THREADS = 1  # these small problems run fastest on one torch thread; build() declares it
PROBLEMS = ("rosenbrock", "least_squares")


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


class Stopping:
    """Keep iterating while the gradient is above tol and fewer than max_iter L-BFGS iterations ran."""

    def __init__(self, optimizer: torch.optim.LBFGS, tol: float, max_iter: int):
        self.optimizer = optimizer
        self.tol = tol
        self.max_iter = max_iter

    def iterations(self) -> int:
        param = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state[param].get("n_iter", 0))

    def keep_going(self, grad_norm: float) -> bool:
        return grad_norm > self.tol and self.iterations() < self.max_iter

    def state_dict(self) -> dict:
        """The optimizer's state dict (tol and max_iter are settings)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


def make_problem(problem: str, dim: int, seed: int) -> Objective:
    if problem == "rosenbrock":
        return Rosenbrock(dim)
    if problem == "least_squares":
        return LeastSquares(dim, seed=seed)
    raise ValueError(f"lbfgs: unknown problem {problem!r}; choose one of {', '.join(PROBLEMS)}")


def build(problem: str = "rosenbrock", dim: int = 10, tol: float = 1e-8, max_iter: int = 500,
          history_size: int = 10, seed: int = 0):
    """Minimize `problem` in `dim` dimensions with L-BFGS (strong-Wolfe line search) until max |grad| <= tol."""
    check_options("lbfgs", counts=dict(dim=dim, max_iter=max_iter, history_size=history_size))
    objective = make_problem(problem, dim, seed)
    optimizer = torch.optim.LBFGS([objective.x], lr=1, max_iter=1, max_eval=25, history_size=history_size,
                                  tolerance_grad=tol, tolerance_change=0.0, line_search_fn="strong_wolfe")
    stopping = Stopping(optimizer, tol, max_iter)
    reg = Registers(optimum=objective.optimum)
    return SEQ([
        CALL(objective.value, store_to=reg("loss")),
        CALL(objective.grad_norm, store_to=reg("grad_norm")),
        WHILE(CALL(stopping.keep_going, reg("grad_norm")), SEQ([
            CALL(optimizer.step, objective),
            CALL(objective.value, store_to=reg("loss")),
            CALL(objective.grad_norm, store_to=reg("grad_norm")),
        ])),
        CALL(stopping.iterations, store_to=reg("iterations")),
        CALL(objective.solution, store_to=reg("x")),
    ]).with_process_settings({"torch.threads": THREADS})


def report(registers) -> str:
    error = np.abs(registers["x"] - registers["optimum"]).max()
    return "\n".join([
        f"L-BFGS: {registers['iterations']} iterations, loss {registers['loss']:.3e}, "
        f"max |gradient| {registers['grad_norm']:.3e}",
        f"largest distance to the known optimum (one coordinate): {error:.3e}",
    ])
