"""What a step costs, learned online from the steps the engine runs: the models the `adaptive` k policy prices
draft tokens with. Plain Python, owned by one engine thread.

Two models, both kept as robust means per measured point ("cell") and read through a local fit:

- `ForwardCost`: seconds of a step besides drafting (target forward, verification, commit) against the number of
  sequences S in the forward and the number of new tokens R it processes. A draft token adds a row at fixed S, so
  what it costs is dT/dR at the current (S, R). Read from a kernel-weighted least-squares plane
  T ~ t0 + b_seqs * (S' - S) + b_rows * (R' - R) through the cells near (S, R): local, because the cost is not
  linear (flat while the weights dominate, steep once compute does); a plane over many cells, because one
  forward on a shared CPU varies by +-30%; rows and sequences apart, because adding a sequence also costs its
  attention and bookkeeping, which a draft token does not pay. While only plain decoding was measured (R = S,
  the two slopes cannot be told apart) the fit gives the whole slope to rows: the cautious reading.
- `DraftCost`: seconds of drafting K positions (a model-based proposer runs one draft forward per position)
  against K, at about the same number of drafting sequences: a line through the origin, fitted near S.

Each cell is a mean of its first samples, then an EMA; once warm, a new sample is clipped to [mean / 2, 2 * mean]
first, so a step that was descheduled by the OS moves the estimate a little, not a lot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

_EMA = 0.2  # weight of a new sample in its cell, once the cell has _WARM samples
_WARM = 4
_MAX_WEIGHT = 20.0  # a cell's weight in a fit: its sample count, capped
_MAX_CELLS = 2048  # beyond this, the least-sampled cells are dropped (a long-lived server sees many shapes)
_REFIT_AFTER = 8  # a fit is reused until this many steps were observed since it was made: a fit reads dozens of
# cells and ran ~3 times a step (~0.5 ms at 32 sequences, ~1 % of a step, paid whatever k is), while one step moves
# one cell's mean by a fifth of its error at most
_MAX_FITS = 512


class _Cell:
    __slots__ = ("count", "mean")

    def __init__(self) -> None:
        self.mean = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        if self.count >= _WARM and self.mean > 0.0:
            seconds = min(max(seconds, self.mean / 2), self.mean * 2)
        self.count += 1
        weight = 1.0 / self.count if self.count <= _WARM else _EMA
        self.mean += weight * (seconds - self.mean)


def _add(cells: dict[tuple[int, int], _Cell], key: tuple[int, int], seconds: float) -> None:
    cell = cells.get(key)
    if cell is None:
        if len(cells) >= _MAX_CELLS:
            for stale in sorted(cells, key=lambda k: cells[k].count)[: _MAX_CELLS // 4]:
                del cells[stale]
        cell = cells[key] = _Cell()
    cell.add(seconds)


def _row_cell(num_rows: int) -> int:
    """Rows are kept exact up to 32, then to about 6 % (prompt chunks make many sizes, a few apart cost the same)."""
    if num_rows <= 32:
        return num_rows
    step = num_rows // 16
    return (num_rows + step // 2) // step * step


def _kernel(distance: float, bandwidth: float) -> float:
    return math.exp(-0.5 * (distance / bandwidth) ** 2)


class LocalCost(NamedTuple):
    """The forward's cost around one (S, R): its predicted seconds there and the seconds one more row adds."""

    seconds: float
    seconds_per_row: float


class ForwardCost:
    """Step seconds besides drafting, by (sequences, new tokens). See the module docstring."""

    def __init__(self) -> None:
        self._cells: dict[tuple[int, int], _Cell] = {}
        self._rows_by_seqs: dict[int, dict[int, _Cell]] = {}  # the same cells, indexed by S for the local fit
        self._num_observed = 0
        self._fits: dict[tuple[int, int], tuple[int, LocalCost | None]] = {}  # (S, R) -> (when fitted, fit)

    @property
    def num_observed(self) -> int:
        """Steps observed so far (the valid ones)."""
        return self._num_observed

    @property
    def num_cells(self) -> int:
        return len(self._cells)

    def observe(self, num_seqs: int, num_rows: int, seconds: float) -> None:
        if num_seqs > 0 and num_rows >= num_seqs and seconds > 0.0 and math.isfinite(seconds):
            self._num_observed += 1
            _add(self._cells, (num_seqs, _row_cell(num_rows)), seconds)
            if len(self._cells) < sum(len(rows) for rows in self._rows_by_seqs.values()) or not self._rows_by_seqs:
                self._rows_by_seqs = {}  # cells were dropped: rebuild the index
                for (s, r), cell in self._cells.items():
                    self._rows_by_seqs.setdefault(s, {})[r] = cell
            else:
                key = (num_seqs, _row_cell(num_rows))
                self._rows_by_seqs.setdefault(num_seqs, {})[key[1]] = self._cells[key]

    def at(self, num_seqs: int, num_rows: int) -> LocalCost | None:
        """The local plane at (num_seqs, num_rows); None until three cells not on one line were measured. A fit is
        reused until _REFIT_AFTER more steps were observed (one that found nothing is redone every time)."""
        key = (num_seqs, num_rows)
        cached = self._fits.get(key)
        if cached is not None and self._num_observed - cached[0] < _REFIT_AFTER and cached[1] is not None:
            return cached[1]
        if len(self._fits) >= _MAX_FITS:
            self._fits.clear()
        fit = self._fit(num_seqs, num_rows)
        self._fits[key] = (self._num_observed, fit)
        return fit

    def _fit(self, num_seqs: int, num_rows: int) -> LocalCost | None:
        if len(self._cells) < 3:
            return None
        seq_width = max(2.0, 0.25 * num_seqs)
        row_width = max(4.0, 0.25 * num_rows)
        # Cells beyond two bandwidths weigh < 14 % of a near one: leave them out (a fit runs twice a step), unless
        # fewer than three are near, then every cell counts (far ones only break ties).
        near = [((s, r), cell)
                for s in range(math.ceil(num_seqs - 2 * seq_width), math.floor(num_seqs + 2 * seq_width) + 1)
                for r, cell in self._rows_by_seqs.get(s, {}).items() if abs(r - num_rows) <= 2 * row_width]
        cells = near if len(near) >= 3 else list(self._cells.items())
        # Normal equations of the weighted fit t ~ c0 + c1 * ds + c2 * dr, centred at the query point.
        m = [[0.0] * 3 for _ in range(3)]
        v = [0.0] * 3
        for (s, r), cell in cells:
            ds, dr = s - num_seqs, r - num_rows
            w = min(float(cell.count), _MAX_WEIGHT) * math.exp(-0.5 * ((ds / seq_width) ** 2 + (dr / row_width) ** 2))
            w = max(w, 1e-9)  # far cells still break ties when nothing is near
            m[0][0] += w
            m[0][1] += w * ds
            m[0][2] += w * dr
            m[1][1] += w * ds * ds
            m[1][2] += w * ds * dr
            m[2][2] += w * dr * dr
            v[0] += w * cell.mean
            v[1] += w * ds * cell.mean
            v[2] += w * dr * cell.mean
        m[1][0], m[2][0], m[2][1] = m[0][1], m[0][2], m[1][2]
        # A small ridge on the sequence slope only: when R - S never varied, rows take the whole slope.
        m[1][1] += 1e-3 * (m[1][1] + m[0][0])
        solution = _solve3(m, v)
        if solution is None:
            return None
        seconds, _, per_row = solution
        if not seconds > 0.0:
            return None
        return LocalCost(seconds, max(0.0, per_row))

    def snapshot(self) -> dict[str, float]:
        """The most-sampled cells' means in ms, keyed "S,R" (at most 12: enough to see the shape)."""
        top = sorted(self._cells.items(), key=lambda item: -item[1].count)[:12]
        return {f"{s},{r}": round(cell.mean * 1e3, 3) for (s, r), cell in sorted(top)}


class DraftCost:
    """Drafting seconds per draft position, by (drafting sequences, positions). See the module docstring."""

    def __init__(self) -> None:
        self._cells: dict[tuple[int, int], _Cell] = {}

    def observe(self, num_drafting: int, num_positions: int, seconds: float) -> None:
        if num_drafting > 0 and num_positions > 0 and seconds >= 0.0 and math.isfinite(seconds):
            _add(self._cells, (num_drafting, num_positions), seconds)

    def per_position(self, num_drafting: int) -> float:
        """Seconds one more draft position costs with `num_drafting` sequences drafting (0 before any draft)."""
        width = max(2.0, 0.25 * num_drafting)
        num = den = 0.0
        for (s, k), cell in self._cells.items():
            w = min(float(cell.count), _MAX_WEIGHT) * max(_kernel(s - num_drafting, width), 1e-9)
            num += w * k * cell.mean
            den += w * k * k
        return num / den if den > 0.0 else 0.0


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """m x = v for a 3x3 system by Cramer's rule; None when (nearly) singular."""

    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    scale = abs(m[0][0] * m[1][1] * m[2][2])
    if scale == 0.0 or abs(d) <= 1e-12 * scale:
        return None
    out = []
    for col in range(3):
        replaced = [[v[row] if c == col else m[row][c] for c in range(3)] for row in range(3)]
        out.append(det(replaced) / d)
    return out[0], out[1], out[2]
