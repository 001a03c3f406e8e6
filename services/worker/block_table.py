"""The block ids of every request the worker holds, one row each, kept across steps.

A step's decode block tables are then one numpy gather of rows (as vLLM's input batch keeps
them), instead of a flatten of every request's whole block list in Python, which at hundreds of
decoding requests with long contexts cost a third of a millisecond a step.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, num_cols: int, num_rows: int = 64) -> None:
        self.table = np.zeros((num_rows, max(1, num_cols)), dtype=np.int64)
        self._widths = np.zeros(num_rows, dtype=np.int64)  # filled columns per row
        self._free = list(range(num_rows - 1, -1, -1))  # pop() takes the lowest row

    def add(self, block_ids: list[int]) -> int:
        """A row holding block_ids; the columns past them stay zero."""
        if not self._free:
            self._grow(rows=2 * len(self.table))
        row = self._free.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self._widths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(cols=max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self._widths[row] = end

    def widths(self, rows: np.ndarray) -> np.ndarray:
        """The filled columns (block count) of each of these rows."""
        return self._widths[rows]

    def release(self, row: int) -> None:
        self.table[row, : self._widths[row]] = 0
        self._widths[row] = 0
        self._free.append(row)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        """Rows are added only when none is free, so the new ones keep `_free` descending."""
        old_rows, old_cols = self.table.shape
        rows, cols = max(rows, old_rows), max(cols, old_cols)
        table = np.zeros((rows, cols), dtype=np.int64)
        table[:old_rows, :old_cols] = self.table
        widths = np.zeros(rows, dtype=np.int64)
        widths[:old_rows] = self._widths
        self.table, self._widths = table, widths
        self._free.extend(range(rows - 1, old_rows - 1, -1))
