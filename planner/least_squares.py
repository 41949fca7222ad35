"""Non-negative linear least squares for the few-parameter cost models (cost_profile.py).

Small problems only (2-4 unknowns, tens of points): the normal equations solved by Gaussian
elimination with partial pivoting, and non-negativity by dropping the most negative
coefficient and refitting the rest (an active set that, for these sizes, converges in at most
as many rounds as there are unknowns). Pure Python: no numpy in the planner.
"""

from __future__ import annotations


def fit(rows: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """Coefficients x >= 0 minimising sum (row . x - y)^2."""
    if not rows or len(rows) != len(ys):
        raise ValueError(f"fit needs as many rows as targets, got {len(rows)} and {len(ys)}")
    k = len(rows[0])
    active = list(range(k))
    while active:
        x = _solve([[r[j] for j in active] for r in rows], ys)
        if x is not None and min(x) >= 0:
            out = [0.0] * k
            for j, v in zip(active, x):
                out[j] = v
            return tuple(out)
        if x is None:  # singular (e.g. one point per unknown short): drop the last unknown
            active.pop()
        else:
            active.pop(min(range(len(x)), key=x.__getitem__))
    return (0.0,) * k


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    k = len(rows[0])
    # Columns are scaled to unit size first: per-token and per-pair columns differ by 1e6.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in range(k)]
         + [sum(r[i] * y for r, y in zip(rows, ys)) / scale[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [v - f * w for v, w in zip(a[i], a[col])]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]
