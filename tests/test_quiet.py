"""``integrations/quiet.py``: --disable_tqdm reaches the libraries' own bars, and transformers'
LOAD REPORT is dropped exactly where asked (its other warnings are not).

The load: a tiny BERT saved as a ``BertModel`` and loaded as ``BertForSequenceClassification``
(its new classifier is MISSING in the checkpoint: the report the examples print once).
"""

from __future__ import annotations

import logging
import re
import sys

import pytest
import transformers

from hf_cephalo.integrations.quiet import (LOAD_REPORT_LOGGER, disable_progress_bars,
                                           quiet_load_report)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def transformers_log():
    """Every record of the ``transformers`` loggers (they do not propagate to the root), at
    transformers' default verbosity (warning) whatever an earlier test in this process left
    (a Trainer sets the verbosity from its ``log_level``), restored after."""
    handler = _Records()
    root = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    root.addHandler(handler)
    yield handler.messages
    root.removeHandler(handler)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=32)
    path = tmp_path_factory.mktemp("bert")
    transformers.BertModel(config).save_pretrained(path)
    return path


def _load(path):
    return transformers.BertForSequenceClassification.from_pretrained(path, num_labels=3)


def _reports(messages):
    return [m for m in messages if "LOAD REPORT" in m]


def test_load_report_is_dropped_only_inside_the_block(bert_dir, transformers_log):
    _load(bert_dir)
    [report] = _reports(transformers_log)  # transformers' own behaviour: once per load
    assert report.startswith(f"{LOAD_REPORT_LOGGER}: ") and "classifier.weight" in report
    transformers_log.clear()
    log = logging.getLogger(LOAD_REPORT_LOGGER)
    filters, level = list(log.filters), log.level
    with quiet_load_report():
        _load(bert_dir)
        log.warning("another warning of the same logger")
    assert transformers_log == [f"{LOAD_REPORT_LOGGER}: another warning of the same logger"]
    assert log.filters == filters and log.level == level  # nothing left behind
    transformers_log.clear()
    with quiet_load_report(False):  # a condition that is False: the report as usual
        _load(bert_dir)
    assert len(_reports(transformers_log)) == 1


def test_disable_progress_bars_reaches_transformers_hub_and_datasets(bert_dir, capfd):
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    datasets = pytest.importorskip("datasets")
    hf_logging.enable_progress_bar()  # whatever the environment (HF_HUB_DISABLE_PROGRESS_BARS)
    _load(bert_dir)
    assert "Loading weights" in capfd.readouterr().err  # the bar a stock load draws
    try:
        disable_progress_bars()
        assert not hf_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
        assert not datasets.is_progress_bar_enabled()
        _load(bert_dir)
        assert "Loading weights" not in capfd.readouterr().err
    finally:  # process-wide switches: back on for the other tests of this process
        hf_logging.enable_progress_bar()
        hub_utils.enable_progress_bars()
        datasets.enable_progress_bars()


@pytest.mark.parametrize("process_index, disable_tqdm, bars_on", [
    (0, False, True), (0, True, False), (1, False, False), (3, True, False)])
def test_progress_bars_from_rank_zero(process_index, disable_tqdm, bars_on, bert_dir, capfd):
    """datasets' map bars and the model-loading bars on rank 0 only: every rank of a job maps
    and loads the same, and each rank's bars interleaved in one terminal (issue 33)."""
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    from hf_cephalo.integrations.quiet import progress_bars_from_rank_zero

    datasets = pytest.importorskip("datasets")
    hf_logging.enable_progress_bar()
    datasets.enable_progress_bars()
    try:
        assert progress_bars_from_rank_zero(process_index, disable_tqdm) is (not bars_on)
        assert hf_logging.is_progress_bar_enabled() is bars_on
        assert hub_utils.are_progress_bars_disabled() is (not bars_on)
        assert datasets.is_progress_bar_enabled() is bars_on
        capfd.readouterr()
        datasets.Dataset.from_dict({"x": list(range(4))}).map(lambda row: row)
        _load(bert_dir)
        err = capfd.readouterr().err
        assert ("Map: 100%" in err and "Loading weights" in err) is bars_on, err
        assert ("Map" in err or "Loading weights" in err) is bars_on, err
    finally:  # process-wide switches: back on for the other tests of this process
        hf_logging.enable_progress_bar()
        hub_utils.enable_progress_bars()
        datasets.enable_progress_bars()


def test_print_line_lands_above_the_bar_not_inside_it(capsys):
    """A line printed while a tqdm bar is drawn (the trainer's re-plan line) starts on a line
    of its own: the bar is cleared first and redrawn after it."""
    from tqdm.auto import tqdm

    from hf_cephalo.integrations.quiet import print_line

    bar = tqdm(total=10, file=sys.stderr, mininterval=0, ascii=True)
    try:
        bar.update(3)
        capsys.readouterr()
        print_line("Cephalo re-plan after step 3")
        out, err = capsys.readouterr()
    finally:
        bar.close()
    assert out == "Cephalo re-plan after step 3\n"
    # cleared (carriage return, blanks, carriage return) before the line, redrawn after it
    assert re.match(r"\r +\r\r? *30%\|", err), repr(err)
