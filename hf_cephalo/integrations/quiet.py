"""Library output a training script governs beyond Trainer's own: progress bars, load reports.

``disable_progress_bars`` is what ``--disable_tqdm`` means for the libraries Trainer does not
drive (Trainer's own bars already follow the flag): datasets' map/filter bars, transformers'
"Loading weights" bar of ``from_pretrained`` and huggingface_hub's download bars.

``progress_bars_from_rank_zero`` keeps those bars on rank 0 only (and off with
``--disable_tqdm``), as Trainer draws its own: every rank of a job maps the same data, and an
in-memory dataset has no cache for ``main_process_first`` to share, so each rank would draw the
same ``datasets.map`` bars into one terminal, interleaved. ``print_line`` prints a line above
the bars being drawn (a re-plan line, a table) instead of into the middle of one.

``quiet_load_report`` silences transformers' LOAD REPORT (the table of missing / unexpected /
mismatched keys ``from_pretrained`` logs as a warning) for loads whose report is noise:

- every rank of a job loads the same checkpoint, so every rank would print the same table;
  the examples let rank 0 print it, once per job (``quiet=process_index != 0``);
- a load whose missing keys the caller fills itself, e.g. a base model whose new head the
  saved LoRA adapter's ``modules_to_save`` copy replaces; the caller then checks the loading
  info (``output_loading_info=True``) instead of showing it.

Errors of the load (shape mismatches without ``ignore_mismatched_sizes``, conversion errors)
still raise: they are exceptions, not the logged report; other warnings of the load are
still printed.
"""

from __future__ import annotations

from hf_cephalo.console import print_line  # noqa: F401 (re-exported: the examples use it)

import contextlib
import logging
from typing import Iterator

__all__ = ["disable_progress_bars", "progress_bars_from_rank_zero", "print_line",
           "quiet_load_report", "LOAD_REPORT_LOGGER"]

# transformers logs the report through its modeling_utils logger (utils/loading_report.py,
# ``log_state_dict_report(..., logger=logger)`` in ``PreTrainedModel._finalize_model_loading``)
LOAD_REPORT_LOGGER = "transformers.modeling_utils"


def disable_progress_bars() -> None:
    """Turn off, for this process, the progress bars of datasets, transformers' model loading
    and huggingface_hub downloads (call it when ``TrainingArguments.disable_tqdm`` is True,
    before loading data or models). datasets is optional: without it only the others."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # also huggingface_hub's bars
    try:
        import datasets
    except ImportError:
        return
    datasets.disable_progress_bars()


def progress_bars_from_rank_zero(process_index: int, disable_tqdm: bool = False) -> bool:
    """Keep the bars of datasets, transformers' model loading and huggingface_hub downloads
    on rank 0 only (``disable_progress_bars`` on every other rank), and off on rank 0 too when
    ``disable_tqdm`` (``TrainingArguments.disable_tqdm``). Call it before loading data or
    models; ``process_index`` is ``TrainingArguments.process_index``. Returns True when this
    process's bars were turned off."""
    if disable_tqdm or process_index != 0:
        disable_progress_bars()
        return True
    return False


class _DropLoadReport(logging.Filter):
    """Drops transformers' load-report record, lets every other record of the logger through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.funcName == "log_state_dict_report"
                    or "LOAD REPORT" in record.getMessage())


@contextlib.contextmanager
def quiet_load_report(quiet: bool = True) -> Iterator[None]:
    """Within the block, transformers' LOAD REPORT of ``from_pretrained`` is not printed; the
    logger's other warnings and errors are (a filter on that logger drops the report record
    only; raising the logger's level instead would also switch on transformers' tensor-parallel
    plan check, which logs "The following layers were not sharded" when the level is >=
    WARNING). ``quiet=False`` changes nothing, so callers can pass a condition
    (``process_index != 0``). The filter is removed on exit."""
    if not quiet:
        yield
        return
    log = logging.getLogger(LOAD_REPORT_LOGGER)
    drop = _DropLoadReport()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
