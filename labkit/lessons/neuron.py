"""Notebook 05's lesson: what ran here, what it showed, and what waits for a Neuron device."""

from __future__ import annotations

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import GAIN, Conclusion, Ratio

#: Largest difference from in-process PyTorch that still counts as the same answer.
TOLERANCE = 1e-3


def neuron_conclusion(
    target: str,
    comparison: pd.DataFrame,
    perf: pd.DataFrame,
    checks: list[str],
) -> Conclusion:
    """Notebook 05's result from what it measured and validated.

    ``target`` is the compile target the notebook used (``cpu`` is the stand-in for Neuron);
    ``comparison`` is :func:`labkit.neuron.walkthrough.compare`'s table, ``perf`` the add_sub
    perf_analyzer sweep, ``checks`` the offline validations of the configs made for the device.
    Throughput from the lowest to the highest concurrency is stated as a :class:`Ratio`: a gain
    only at x``GAIN`` or more, a loss at x``1/GAIN`` or less, else within the noise.
    """
    if perf.empty or comparison.empty:
        raise ConfigError("neuron_conclusion needs the comparison table and a perf sweep")
    worst = float(comparison["max_abs_diff"].max())
    same = worst < TOLERANCE
    low, high = perf.sort_values("concurrency").iloc[[0, -1]].itertuples()
    scaling = Ratio.between(high.throughput, low.throughput, "infer/s")
    on_device = target != "cpu"
    where = (
        f"on {target} NeuronCores"
        if on_device
        else "on this host's CPU, the stand-in target (torch.jit.trace and torch.jit.load "
        "in place of torch_neuronx)"
    )
    lines = [
        f"The models were compiled and served {where}. Triton's answers "
        + (
            f"match in-process PyTorch: the largest difference is {worst:.1e} (under {TOLERANCE:g})."
            if same
            else f"differ from in-process PyTorch by up to {worst:.1e}, over the {TOLERANCE:g} "
            "allowed: the compiled model does not compute what the eager one does."
        ),
    ]
    if scaling.value >= GAIN:
        trend = f"a gain of {scaling}: more requests in flight kept the instance busier"
    elif scaling.value <= 1 / GAIN:
        trend = f"a loss of {scaling}: more clients only queued, and each waited longer"
    else:
        trend = f"{scaling}, within x{GAIN:g} either way: no gain from more clients here"
    lines.append(
        f"add_sub served {low.throughput:.0f} infer/s at concurrency {int(low.concurrency)} "
        f"(p99 {low.p99_ms:.1f} ms) and {high.throughput:.0f} at {int(high.concurrency)} "
        f"(p99 {high.p99_ms:.1f} ms): {trend}."
    )
    if not on_device:
        lines.append(
            "These are CPU figures, not Inferentia's: the same folders with TARGET inf2 point at "
            "Neuron-compiled artifacts, which are made and timed on an inf2/trn1 host."
        )
    lines.append(
        f"Validated offline, for the device: {len(checks)} checks ("
        + "; ".join(checks)
        + "). The hardware takes over at compile (neuronx-cc), at model load "
        "(NEURON_RT_VISIBLE_CORES) and for the LLM's vLLM engine with the vllm-neuron plugin."
    )
    figures = {
        "target": target,
        "max_abs_diff": worst,
        "answers_match": same,
        "add_sub_infer_s_low": round(float(low.throughput), 1),
        "add_sub_infer_s_high": round(float(high.throughput), 1),
        "concurrency_scaling": scaling,
        "offline_checks": len(checks),
    }
    table = pd.DataFrame(
        [
            {"what": "answers vs PyTorch", "result": f"max |diff| {worst:.1e}", "ran": where},
            {
                "what": "throughput, lowest -> highest concurrency",
                "result": str(scaling),
                "ran": where,
            },
            *({"what": "offline check", "result": c, "ran": "here, no device"} for c in checks),
        ]
    )
    takeaway = (
        ("Compiled and served, the answers match PyTorch's" if same
         else "Compiled and served, the answers differ from PyTorch's")
        + f" (largest difference {worst:.1e}, {where.split(',')[0]}).",
        f"add_sub from concurrency {int(low.concurrency)} to {int(high.concurrency)}: {scaling}"
        + ("" if on_device else ", a CPU figure, not Inferentia's")
        + ".",
        f"{len(checks)} device configs and plans were validated offline; the hardware takes "
        "over at compile, model load and the vLLM engine.",
    )  # fmt: skip
    return Conclusion(table, figures, "\n".join(lines), takeaway)
