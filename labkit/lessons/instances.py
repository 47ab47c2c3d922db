"""One explanation of model instances on a CPU, shared by notebooks 04 and 07.

On a CPU an extra instance brings no new hardware: it is one more copy of the model whose torch
threads share the same cores. So it can only gain by putting to work a core that one instance
leaves idle, and only where that one instance cannot already use it. Two things decide that:

- the **thread budget**: each instance runs ``threads`` torch threads, so ``k`` instances can
  keep ``min(k * threads, cores)`` cores busy;
- **batching**: an instance that already runs several requests in one ``execute`` (dynamic
  batching, ``batch`` requests per call on average) spends its core on all of them at once. A
  second instance then splits those batches in two and its threads take turns with the client's
  on the same cores.

04 searches a batching model (two instances gain less than 2x on a free host, and lose where
other work takes the second core), 07 measures a model that does not batch (two instances gain): :func:`predict_instances` says which to expect from the same three numbers in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import ConfigError

#: One paragraph, the same in notebooks 04, 07 and 08, that ties their instance figures together.
INSTANCES_ACROSS = (
    "Instances, the same rule in notebooks 04, 07 and 08: on a CPU a second instance brings no "
    "new hardware, only a second copy of the model whose torch threads can use a core the first "
    "leaves idle. The lab gives each instance its thread budget (the cores less one, shared "
    "among the instances, at least 1), so on 2 cores one instance keeps one core busy and "
    "leaves the other to the client, the server's own threads and any other step, which wait "
    "most of the time while a long call runs. So a second instance gains where each call is "
    "long and that core is idle (07's generations of 64 tokens, 08's long texts, 04's search "
    "on both cores), up to about 2x, as much as that core was idle; on a host where other work takes "
    "that core, it gains nothing; and it loses where there is no idle core at all: 04's "
    "rounds, whose server has one core."
)


@dataclass(frozen=True)
class InstancePrediction:
    """What ``instances`` instances should do against one, and the sentence that says why."""

    instances: int
    threads: int
    cores: int
    busy_one: int  # cores one instance can keep busy
    busy_many: int  # cores ``instances`` instances can keep busy
    batch: float  # requests per execution with one instance (1: no batching)
    expect: str  # "gain", "smaller gain" (a batching instance), "no gain" or "loss"
    text: str

    def __str__(self) -> str:
        return self.text


def predict_instances(
    *, instances: int, threads: int, cores: int, batch: float = 1.0
) -> InstancePrediction:
    """What ``instances`` instances of ``threads`` torch threads each should give on ``cores``
    cores against one instance, when one instance executes ``batch`` requests per call."""
    if instances < 2 or threads < 1 or cores < 1 or batch < 1:
        raise ConfigError(
            "predict_instances() needs instances >= 2, threads >= 1, cores >= 1 and batch >= 1, got "
            f"instances={instances}, threads={threads}, cores={cores}, batch={batch}"
        )
    busy_one, busy_many = min(threads, cores), min(instances * threads, cores)
    held = (
        f"one instance already keeps the server's one core busy, and {instances} share that core"
        if cores == 1
        else f"one instance keeps {busy_one} of the {cores} cores busy and {instances} keep "
        f"{busy_many}"
    )
    budget = f"Each instance runs {threads} torch thread{'s' if threads > 1 else ''}, so {held}."
    if busy_many <= busy_one:
        why = "No core is left idle for another instance to use, so expect no gain" + (
            f"; and as one instance already runs {batch:.1f} requests per execution, a second "
            "splits those batches between two copies that take turns on the same cores: expect "
            "a loss."
            if batch >= 1.5
            else "."
        )
        expect = "loss" if batch >= 1.5 else "no gain"
    elif batch >= 1.5:
        why = (
            f"But one instance already runs {batch:.1f} requests per execution, so a second "
            "splits those batches: it gains only while that core is really free, and less than "
            f"{busy_many / busy_one:.0f}x, as each execution then serves fewer requests; where "
            "other work takes the core, it loses."
        )
        expect = "smaller gain"
    else:
        why = (
            "One instance runs one request at a time and leaves a core idle; a second puts that "
            f"core to work: expect up to about {busy_many / busy_one:.0f}x the requests per second."
        )
        expect = "gain"
    return InstancePrediction(
        instances, threads, cores, busy_one, busy_many, float(batch), expect, f"{budget} {why}"
    )
