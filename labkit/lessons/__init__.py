"""The conclusions the lab's measurements support, stated next to the tutorial's own figures.

One module per notebook's lesson. Each function takes what a notebook measured and returns a
:class:`Conclusion`: a table, the headline figures (for :func:`labkit.lab.record`) and the
sentences a learner reads, computed from those figures. A difference within the measured noise is
called so, never a win; a gain or a loss is stated one way, as a :class:`Ratio`.
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
from labkit.lessons.instances import INSTANCES_ACROSS, InstancePrediction, predict_instances
from labkit.lessons.neuron import neuron_conclusion
from labkit.lessons.scale_out import scale_out_conclusion, scale_out_prediction, with_failover
from labkit.lessons.search import search_conclusion
from labkit.lessons.takeaway import Takeaway, deploy_takeaway, multi_model_takeaway, setup_takeaway

__all__ = [
    "GAIN",
    "INSTANCES_ACROSS",
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
