"""The figures and verdicts of the lab's lessons; the words that explain them are the notebooks'
markdown.

One module per notebook's lesson. Each function takes what a notebook measured and returns a
:class:`Conclusion`: the tables, the verdicts (:class:`Verdict`, judged by the lab's one rule,
:func:`judge`), the headline figures (for :func:`labkit.lab.record`) and a takeaway of at most
three sentences built from those verdicts. A gain or a loss is stated one way, as a
:class:`Ratio`; a difference within the noise is a tie.
"""

from labkit.lessons.analyzer import confirm_winner, search_figures
from labkit.lessons.batching import batching_conclusion
from labkit.lessons.conclusion import (
    GAIN,
    NOISE_RULE,
    Conclusion,
    Ratio,
    Verdict,
    figure_text,
    judge,
    noise_band,
    verdict_table,
)
from labkit.lessons.inflight import inflight_conclusion
from labkit.lessons.instances import InstancePrediction, predict_instances
from labkit.lessons.neuron import neuron_conclusion
from labkit.lessons.scale_out import scale_out_conclusion, scale_out_prediction, with_failover
from labkit.lessons.search import search_conclusion
from labkit.lessons.takeaway import Takeaway, deploy_takeaway, multi_model_takeaway, setup_takeaway

__all__ = [
    "GAIN",
    "NOISE_RULE",
    "Conclusion",
    "InstancePrediction",
    "Ratio",
    "Verdict",
    "Takeaway",
    "batching_conclusion",
    "confirm_winner",
    "deploy_takeaway",
    "figure_text",
    "inflight_conclusion",
    "judge",
    "multi_model_takeaway",
    "neuron_conclusion",
    "noise_band",
    "predict_instances",
    "scale_out_conclusion",
    "scale_out_prediction",
    "search_conclusion",
    "search_figures",
    "setup_takeaway",
    "verdict_table",
    "with_failover",
]
