"""Notebook 02's figures: how many copies of a model fit in memory, what a semantic search ranked
first and which words it shares with the question, and capacity tables in a learner's words."""

from __future__ import annotations

import math

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion

_STOP = """a about after all also am an and any are as at be been before being between both but by
    can could did do does doing down during each every few for from further get got had has have
    having he her here hers him his how i if in into is it its just me more most my no nor not
    now of off on once one only or other our ours out over own same she should so some such than
    that the their theirs them then there these they this those through to too under until up
    very was we were what when where which while who whom why will with would you your yours"""
#: Words that carry no topic: a passage sharing only these with the question shares no word.
STOP_WORDS = frozenset(_STOP.split())


def normalize(word: str) -> str:
    """A word's lower-case letters and digits, a plural ending taken off (``Trains`` -> ``train``):
    ``-ies`` -> ``-y``; ``-ches``, ``-shes``, ``-sses``, ``-xes`` lose ``-es``; another final ``s``
    (but ``-ss``, ``-us``, ``-is``) goes. A light rule, not a stemmer."""
    word = "".join(ch for ch in word.lower() if ch.isalnum())
    if len(word) <= 3:
        return word
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "sses", "xes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def content_words(text: str) -> set[str]:
    """The normalized words of ``text`` that are not stop words."""
    words = {normalize(w) for w in text.split()}
    return {w for w in words if w and w not in STOP_WORDS}


def search_conclusion(question: str, hits: pd.DataFrame) -> Conclusion:
    """:func:`labkit.embedding.search`'s ranking as a table with the words each passage shares
    with the question, and its figures: the winner, its score, its lead over the runner-up
    (``margin``, between the scores as shown, to 3 decimals) and the words it shares."""
    if hits.empty or not {"document", "score"} <= set(hits.columns):
        raise ConfigError(
            "search_conclusion() needs the ranked passages with a 'document' and a 'score' "
            f"column, got columns {list(hits.columns)} and {len(hits)} row(s)"
        )
    ranked = hits.sort_values("score", ascending=False).assign(score=hits["score"].round(3))
    asked = content_words(question)
    shared = [sorted(content_words(doc) & asked) for doc in ranked["document"]]
    table = ranked.assign(**{"words shared with the question": [", ".join(s) for s in shared]})
    table = table.rename(columns={"document": "passage", "score": "similarity (cosine)"})
    scores = list(ranked["score"])
    figures: dict = {"question": question, "winner": ranked.iloc[0]["document"],
                     "winner_score": scores[0], "shared_words": shared[0]}  # fmt: skip
    lead = ""
    if len(scores) > 1:
        figures["margin"] = round(scores[0] - scores[1], 3)
        lead = f", {figures['margin']:.3f} ahead of the next"
    text = (f'Ranked first: "{figures["winner"]}" ({scores[0]:.3f}{lead}); words it shares with '
            f"the question: {', '.join(shared[0]) or 'none'}.")  # fmt: skip
    return Conclusion(table, figures, text)


def how_many_fit(measured_gib: pd.Series, available_gib: float) -> pd.DataFrame:
    """How many copies of each model (``measured_gib``: :meth:`labkit.capacity.Plan.compare`'s
    ``measured (GiB)``) the memory available before any was loaded holds: the division as it is
    done, cut to hundredths (``22.83 / 1.131 = 20.18``), and its whole part."""
    available = round(float(available_gib), 2)
    columns = ["model", "available (GiB)", "one copy (GiB)", "available / one copy",
               "copies that fit"]  # fmt: skip
    rows = []
    for model, gib in measured_gib.items():
        gib = round(float(gib), 3)
        if not gib > 0:  # not measured (NaN) or held nothing on this device
            continue
        # cut, not rounded, so the quotient shown never reads as one copy more: 54.999 -> 54.99
        hundredths = math.floor(available / gib * 100)
        arithmetic = f"{available:.2f} / {gib:.3f} = {hundredths / 100:.2f}"
        rows.append((model, available, gib, arithmetic, hundredths // 100))
    return pd.DataFrame(rows, columns=columns).set_index("model")


#: Columns of :mod:`labkit.capacity`'s tables whose names say less than they should to a learner.
PLAN_WORDS = {
    "count from": "parameters counted from",
    "resident (GiB)": "resident host memory (GiB)",
    "gpu (GiB)": "GPU memory (GiB)",
}


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A capacity table with its terse column names in words and yes/no for True/False."""
    shown = frame.rename(columns=PLAN_WORDS)
    for column in shown.columns:
        if shown[column].dtype == bool:
            shown[column] = shown[column].map({True: "yes", False: "no"})
    return shown
