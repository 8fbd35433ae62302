"""When drafting pays: a step's measured cost per row against a draft's expected yield.

A decode step of n rows takes about ``t(n) = a + b n`` seconds (the weights are read once
per step, each row adds its share of products, the LM head and attention): fitted online by
least squares over recent decode steps (each observation's weight decays, so the fit
follows the machine's load), starting from a prior that fades as steps are observed.

A request whose drafted tokens are each accepted with probability p (a run ends at the
first rejection) gets ``p + p^2 + ... + p^k`` extra tokens from k drafted rows, and each row
costs ``b``, which the batch's B plain tokens would have paid ``t(B) / B`` each. The i-th
drafted token pays when ``p^i > q`` with ``q = b B / t(B)``, so

    k = the largest i <= k_max with p^i > q        (0: do not draft)

At batch 1 on a CPU q is small (a step is mostly the weights' read) and drafting pays for
modest p; as B grows, q goes to 1 and drafting stops unless nearly every token is accepted.
"""

from __future__ import annotations

import math


class StepCosts:
    def __init__(self, prior_base_s: float, prior_row_s: float, decay: float = 0.97) -> None:
        """``prior_*``: a and b until steps are measured (two pseudo-steps, at 1 and 16 rows,
        that fade like old observations)."""
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        for n in (1, 16):
            self._add(n, prior_base_s + prior_row_s * n)

    def _add(self, x: float, y: float) -> None:
        self._w += 1.0
        self._x += x
        self._y += y
        self._xx += x * x
        self._xy += x * y

    def observe(self, num_rows: int, seconds: float) -> None:
        """A decode step of ``num_rows`` rows took ``seconds``."""
        d = self.decay
        self._w, self._x, self._y, self._xx, self._xy = (d * self._w, d * self._x, d * self._y, d * self._xx,
                                                         d * self._xy)
        self._add(num_rows, seconds)

    @property
    def row_s(self) -> float:
        """b: seconds a step's one more row costs (>= 0)."""
        var = self._xx - self._x * self._x / self._w
        if var <= 1e-12:
            return 0.0
        return max(0.0, (self._xy - self._x * self._y / self._w) / var)

    @property
    def base_s(self) -> float:
        """a: seconds of a step with no rows."""
        return max(0.0, (self._y - self.row_s * self._x) / self._w)

    def step_s(self, num_rows: int) -> float:
        """t(n): seconds of a step of ``num_rows`` rows."""
        return self.base_s + self.row_s * num_rows

    def row_share(self, batch: int) -> float:
        """q: a row's cost over the cost per token of a plain step of ``batch`` rows."""
        step = self.step_s(batch)
        return self.row_s * batch / step if step > 0 else 1.0


def draft_length(p: float, q: float, k_max: int) -> int:
    """The largest k <= ``k_max`` whose last drafted token still pays (``p^k > q``); 0 when none."""
    if p <= q:
        return 0
    if q <= 0.0 or p >= 1.0:
        return k_max
    # p^k > q  <=>  k < log q / log p (both logs negative): the largest such integer
    return min(k_max, math.ceil(math.log(q) / math.log(p)) - 1)


class FixedCosts(StepCosts):
    """Costs that observations do not move (``kvserve bench spec --always-draft`` sets a step's
    drafted rows and drafting passes free this way, so every request drafts all it may)."""

    def __init__(self, base_s: float, row_s: float) -> None:
        super().__init__(base_s, row_s, decay=1.0)

    def observe(self, num_rows: int, seconds: float) -> None:
        pass
