"""The measured compute time of a forward pass: an EMA the cost-aware adjuster reads every step.

Two ways in:
  * `observe_compute(s)`: the compute time is known (the simulator's cost model);
  * `observe_forward(forward_s, copy_s)`: the engine measured the wall time of a forward pass during which
    `copy_s` of expert copies (bytes loaded / bandwidth) were issued. Copies hide behind up to
    `copy_overlap` of compute, so forward = c + max(0, copy - overlap * c). The sample subtracts the copy
    time that the current estimate says was exposed: exact when the copies hid (forward = c), and a
    contraction towards c (factor `overlap`) when they did not:
        sample = forward - max(0, copy - overlap * c_prev)   ->   (1 - overlap) c + overlap c_prev
    so a copy-bound step is never mistaken for a long compute step (which would make copies look hideable).
"""

from __future__ import annotations


class StepCostTracker:
    def __init__(self, alpha: float = 0.1, copy_overlap: float = 0.8) -> None:
        if not 0.0 < alpha <= 1.0 or not 0.0 <= copy_overlap <= 1.0:
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= copy_overlap <= 1, got {alpha}, {copy_overlap}")
        self.alpha = alpha
        self.copy_overlap = copy_overlap
        self.compute_s: float | None = None  # EMA of the step compute time; None before the first step
        self.steps = 0

    def observe_compute(self, compute_s: float) -> None:
        if compute_s < 0:
            raise ValueError(f"compute time must be >= 0, got {compute_s}")
        self.compute_s = compute_s if self.compute_s is None else (
            self.alpha * compute_s + (1.0 - self.alpha) * self.compute_s)
        self.steps += 1

    def observe_forward(self, forward_s: float, copy_s: float = 0.0) -> None:
        prev = self.compute_s if self.compute_s is not None else 0.0
        exposed = max(0.0, copy_s - self.copy_overlap * prev)
        self.observe_compute(max(0.0, forward_s - exposed))

    def __call__(self) -> float | None:
        return self.compute_s
