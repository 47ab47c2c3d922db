"""What the thread budget predicts for more model instances on a CPU, as numbers.

``k`` instances of ``threads`` torch threads each can keep ``min(k * threads, cores)`` cores
busy; labkit's default budget gives one instance alone every core and ``k`` instances a share
each, so the two sides may run different thread counts (``threads_each``). A second instance
can only gain by using a core one instance leaves idle, and where one instance already runs
several requests per execution it splits those batches. Why, and what a
gain, a tie or a loss then means, is each notebook's markdown (04, 07, 08).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from labkit.errors import ConfigError

#: A request count per execution from which one instance counts as batching.
BATCHING = 1.5


@dataclass(frozen=True)
class InstancePrediction:
    """What ``instances`` instances should do against one, from the thread budget."""

    instances: int
    threads: int
    cores: int
    busy_one: int  # cores one instance can keep busy, its work split over all its threads
    busy_many: int  # cores ``instances`` instances can keep busy
    batch: float  # requests per execution with one instance (1: no batching)
    expect: str  # "gain", "smaller gain", "no gain", "loss" or "gain if its work does not split"
    text: str
    threads_each: int | None = None  # torch threads of each of ``instances`` (None: ``threads``)
    busy_one_least: int | None = None  # ... its work not split: as busy as one of the copies

    def __str__(self) -> str:
        return self.text

    @property
    def ceiling(self) -> float:
        """The most the idle cores allow: busy cores with ``instances`` over with one (whose
        work, with more threads than each copy, may not split over them)."""
        return self.busy_many / (self.busy_one_least or self.busy_one)

    @property
    def busy_one_said(self) -> str:
        """The cores one instance keeps busy, as a range where that depends on its work."""
        least = self.busy_one_least or self.busy_one
        return str(self.busy_one) if least == self.busy_one else f"{least} to {self.busy_one}"


def predict_instances(
    *, instances: int, threads: int, cores: int, batch: float = 1.0, threads_each: int | None = None
) -> InstancePrediction:
    """What ``instances`` instances of ``threads_each`` torch threads each (default: ``threads``)
    should give on ``cores`` cores against one instance of ``threads`` threads, when one instance
    executes ``batch`` requests per call."""
    each = threads if threads_each is None else threads_each
    if instances < 2 or threads < 1 or each < 1 or cores < 1 or batch < 1:
        raise ConfigError(
            "predict_instances() needs instances >= 2, threads >= 1, cores >= 1 and batch >= 1, got "
            f"instances={instances}, threads={threads}, threads_each={each}, cores={cores}, "
            f"batch={batch}"
        )
    busy_one, busy_many = min(threads, cores), min(instances * each, cores)
    # One instance's threads keep its cores busy only as far as its work splits between them:
    # with no more threads than a copy has, it is at least as busy as one copy.
    least = min(each, cores) if each < threads else busy_one
    batching = batch >= BATCHING
    if busy_many <= least:
        expect = "loss" if batching else "no gain"
    elif busy_many <= busy_one:
        expect = "gain if its work does not split"
    else:
        expect = "smaller gain" if batching else "gain"
    if busy_many <= least:
        ceiling = "no idle core"
    elif busy_many <= busy_one:
        ceiling = (
            f"up to about {busy_many / least:.0f}x where one instance's work does not split over "
            "its threads, none where it does"
        )
    else:
        ceiling = f"up to about {busy_many / least:.0f}x"
    busy_said = str(busy_one) if least == busy_one else f"{least} to {busy_one}"
    threads_said = (
        f"{threads} torch thread{'s' if threads > 1 else ''} each"
        if each == threads
        else f"1 instance of {threads} torch threads, {instances} of {each} each,"
    )
    text = (
        f"{threads_said} on {cores} core{'s' if cores > 1 else ''}: 1 instance keeps {busy_said} "
        f"busy, {instances} keep {busy_many} ({ceiling}); {batch:.1f} requests per execution: "
        f"expect {expect}."
    )
    return InstancePrediction(
        instances, threads, cores, busy_one, busy_many, float(batch), expect, text, each,
        None if least == busy_one else least,
    )  # fmt: skip


def prediction_table(predictions: list[InstancePrediction]) -> pd.DataFrame:
    """The predictions side by side: one row each, the thread budget's numbers."""
    return pd.DataFrame(
        {
            "server's cores": p.cores,
            "torch threads per instance": (
                p.threads
                if p.threads_each in (None, p.threads)
                else f"{p.threads} alone, {p.threads_each} each of {p.instances}"
            ),
            "cores busy, 1 instance": p.busy_one_said,
            f"cores busy, {p.instances} instances": p.busy_many,
            "requests per execution, 1 instance": round(p.batch, 1),
            "expect": p.expect,
        }
        for p in predictions
    )
