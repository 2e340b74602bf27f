"""The order in which column sums add their rows: one module for the column-sum kernel
(emit_columns) and for row kernels that also sum columns over their rows
(row_column_sums.column_sum_runs), so both add the same partials and their sums are the same
bits."""

ROWS_PER_BLOCK = 1024  # most kept elements a work item reduces at once (4 KiB of fp32 sums)
SPLIT_MIN = 64  # fewest columns per part when the columns are split between threads
# A float sum adds SUM_BLOCK reduced elements into fp32 partial sums, then each partial into
# a double total: one fp32 accumulator saturates over very many rows, and 256-row blocks were
# 13x farther from float64 than eager on a cancelling 496-row sum (fuzz seed 33342). Eager's
# column sum (ATen's cascade_sum, vectorised over 4 x 8 columns) adds rows in runs of 16 from
# row 0, then sums those partials in fp32 (level by level); 16 here gives the same partials,
# totalled in double, so never less accurate (32 rows: 6x eager's error, fuzz seed 50261).
SUM_BLOCK = 16
