"""The Trainer door's loaders: stock's dataset preparation (column pruning, the sampling
strategy's lengths, the collator wrapper), then the runtime's weighted split (``Session.
train_loader`` / ``eval_loader``: rank i gets exactly b_i samples of each global batch, also of
a stream). Mixed into ``CephaloTrainerMixin`` (trainer.py)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from hf_cephalo.integrations.trainer.accumulation import warn_rows_dropped, with_accumulation_steps
from hf_cephalo.runtime import is_stream

__all__ = ["TrainerDataMixin"]


class TrainerDataMixin:
    """``get_train_dataloader`` / ``get_eval_dataloader`` / ``get_test_dataloader`` on the
    session's loaders, for a ``Trainer`` subclass with a ``session`` and a ``plan``."""

    def _loader_inputs(self, dataset, description: str, *, lengths: bool):
        """(dataset, collator, lengths) as stock prepares them for a loader: unused columns
        pruned (a dataset with a transform keeps its raw columns; unused keys are then dropped
        per sample after the transform, so an image column survives), per-sample lengths for
        ``group_by_length`` read from the dataset as given."""
        import datasets

        if is_stream(dataset) and description != "training":
            raise ValueError(f"{description}: CephaloTrainer evaluates a dataset with a length "
                             "(its rows are split by the plan's b_i and gathered in order): "
                             "materialize it first, e.g. datasets.Dataset.from_generator")
        collator = self.data_collator
        sizes = self._sample_lengths(dataset) if lengths and not is_stream(dataset) else None
        if isinstance(dataset, datasets.Dataset) and dataset.format.get("type") != "custom":
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        return dataset, collator, sizes

    def _sample_lengths(self, dataset) -> list[int]:
        """Per-sample lengths for group_by_length, as stock: the ``length_column_name`` column,
        else the length of each sample's first model input (``input_ids`` by default).

        Raises ValueError when neither exists."""
        import datasets

        column = self.args.length_column_name
        if isinstance(dataset, datasets.Dataset) and column in dataset.column_names:
            return [int(n) for n in dataset[column]]
        name = (self.processing_class.model_input_names[0] if self.processing_class is not None
                and hasattr(self.processing_class, "model_input_names") else "input_ids")
        first = dataset[0]
        if not hasattr(first, "keys") or name not in first:
            raise ValueError(f"train_sampling_strategy='group_by_length' needs a {column!r} column "
                             f"or samples with {name!r} (length_column_name / the processor's "
                             "first input): set --length_column_name to a column of per-sample "
                             "lengths, or use --train_sampling_strategy random")
        return [len(dataset[i][name]) for i in range(len(dataset))]

    def get_train_dataloader(self) -> DataLoader:
        """This rank's loader: b_i samples per step as microbatches of m_i (not Accelerate-prepared)."""
        if self.train_dataset is None:
            raise ValueError("CephaloTrainer: training requires a train_dataset; pass "
                             "CephaloTrainer(..., train_dataset=...)")
        strategy = str(getattr(self.args.train_sampling_strategy, "value",
                               self.args.train_sampling_strategy))
        dataset, collator, lengths = self._loader_inputs(
            self.train_dataset, "training", lengths=strategy == "group_by_length")
        loader = self.session.train_loader(dataset, collator, shuffle=strategy == "random",
                                           drop_last=self.args.dataloader_drop_last,
                                           lengths=lengths)
        k = self.args.gradient_accumulation_steps  # > 1: [Note: the stock loop's k batches]
        if self.is_world_process_zero() and self.args.dataloader_drop_last:
            warn_rows_dropped(dataset, self.plan.global_batch_size, k)
        return with_accumulation_steps(loader, k)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Unshuffled rank-weighted split of the eval set in microbatches of per_device_eval_batch_size."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("CephaloTrainer: evaluation requires an eval_dataset; pass "
                             "CephaloTrainer(..., eval_dataset=...) or evaluate(eval_dataset)")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        if self.args.dataloader_drop_last:
            eval_dataset = self._stock_drop_last_eval(eval_dataset)
        dataset, collator, _ = self._loader_inputs(eval_dataset, "evaluation", lengths=False)
        return self.session.eval_loader(dataset, collator,
                                        microbatch_size=self.args.per_device_eval_batch_size)

    def _stock_drop_last_eval(self, dataset):
        """``dataloader_drop_last`` in evaluation, as stock: W processes take turns reading
        whole batches of ``per_device_eval_batch_size`` b in dataset order and an incomplete last
        round is dropped (Accelerate's ``BatchSamplerShard``), so stock evaluates the first
        floor(N / (W b)) W b samples; so does this (W = world size)."""
        import datasets

        round_size = self.args.world_size * self.args.per_device_eval_batch_size
        keep = len(dataset) // round_size * round_size
        if keep == len(dataset):
            return dataset
        if isinstance(dataset, datasets.Dataset):
            return dataset.select(range(keep))
        return torch.utils.data.Subset(dataset, range(keep))

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.get_eval_dataloader(test_dataset)
