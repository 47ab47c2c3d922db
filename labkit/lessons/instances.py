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
    busy_one: int  # cores one instance can keep busy
    busy_many: int  # cores ``instances`` instances can keep busy
    batch: float  # requests per execution with one instance (1: no batching)
    expect: str  # "gain", "smaller gain" (a batching instance), "no gain" or "loss"
    text: str
    threads_each: int | None = None  # torch threads of each of ``instances`` (None: ``threads``)

    def __str__(self) -> str:
        return self.text

    @property
    def ceiling(self) -> float:
        """The most the idle cores allow: busy cores with ``instances`` over with one."""
        return self.busy_many / self.busy_one


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
    batching = batch >= BATCHING
    if busy_many <= busy_one:
        expect = "loss" if batching else "no gain"
    else:
        expect = "smaller gain" if batching else "gain"
    ceiling = f"up to about {busy_many / busy_one:.0f}x" if busy_many > busy_one else "no idle core"
    threads_said = (
        f"{threads} torch thread{'s' if threads > 1 else ''} each"
        if each == threads
        else f"1 instance of {threads} torch threads, {instances} of {each} each,"
    )
    text = (
        f"{threads_said} on {cores} core{'s' if cores > 1 else ''}: 1 instance keeps {busy_one} "
        f"busy, {instances} keep {busy_many} ({ceiling}); {batch:.1f} requests per execution: "
        f"expect {expect}."
    )
    return InstancePrediction(
        instances, threads, cores, busy_one, busy_many, float(batch), expect, text, each
    )


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
            "cores busy, 1 instance": p.busy_one,
            f"cores busy, {p.instances} instances": p.busy_many,
            "requests per execution, 1 instance": round(p.batch, 1),
            "expect": p.expect,
        }
        for p in predictions
    )
