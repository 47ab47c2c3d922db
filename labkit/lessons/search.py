"""Notebook 02's lessons: what a memory plan decided and why, and what a semantic search's
ranking shows, and only that.

:func:`plan_in_words` says each model that a plan (:func:`labkit.capacity.plan`) did not load as
asked, and why, in a learner's words: too big for the memory left, and what took its place.

An embedding search is said to find a passage "even when it shares no word with the question".
:func:`search_conclusion` says so only when the winning passage really shares no word with the
question (stop words aside); otherwise it names the shared words. It also says by how much the
winner led the runner-up, and whether that lead is small.
"""

from __future__ import annotations

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion

#: A lead in cosine similarity below which the winner's place is called fragile.
SMALL_MARGIN = 0.05

_STOP = """a about after all also am an and any are as at be been before being between both but by
    can could did do does doing down during each every few for from further get got had has have
    having he her here hers him his how i if in into is it its just me more most my no nor not
    now of off on once one only or other our ours out over own same she should so some such than
    that the their theirs them then there these they this those through to too under until up
    very was we were what when where which while who whom why will with would you your yours"""
#: Words that carry no topic: a passage sharing only these with the question shares no word.
STOP_WORDS = frozenset(_STOP.split())


def normalize(word: str) -> str:
    """A word's lower-case letters and digits, its plural ending taken off (``Trains`` -> ``train``).

    A light rule, not a stemmer: ``-ies`` -> ``-y``; ``-ches``, ``-shes``, ``-sses``, ``-xes``
    lose ``-es``; any other final ``s`` (but ``-ss``, ``-us``, ``-is``) goes.
    """
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
    """What a ranking shows: the winner, its lead over the runner-up, the words it shares.

    ``hits`` is :func:`labkit.embedding.search`'s frame: a ``document`` and a ``score`` column,
    best first. The table, in a learner's words (passage, similarity), adds for each passage the
    words it shares with the question.
    """
    if hits.empty or not {"document", "score"} <= set(hits.columns):
        raise ConfigError(
            "search_conclusion() needs the ranked passages with a 'document' and a 'score' "
            f"column, got columns {list(hits.columns)} and {len(hits)} row(s)"
        )
    # the words quote scores to 3 decimals; the lead is taken between the scores as quoted
    ranked = hits.sort_values("score", ascending=False).assign(score=hits["score"].round(3))
    asked = content_words(question)
    shared = [sorted(content_words(doc) & asked) for doc in ranked["document"]]
    table = ranked.assign(**{"words shared with the question": [", ".join(s) for s in shared]})
    table = table.rename(columns={"document": "passage", "score": "similarity (cosine)"})
    winner, score = ranked.iloc[0]["document"], float(ranked.iloc[0]["score"])
    figures: dict = {
        "question": question,
        "winner": winner,
        "winner_score": round(score, 3),
        "shared_words": shared[0],
    }
    lines = [f'For "{question}", the passage ranked first is "{winner}" (score {score:.3f}).']
    if len(ranked) > 1:
        second = float(ranked.iloc[1]["score"])
        margin = round(score - second, 3)
        figures["margin"] = margin
        size = (
            f"a small lead (under {SMALL_MARGIN}): a slightly different wording of the question "
            "could swap them"
            if margin < SMALL_MARGIN
            else "a clear lead"
        )
        lines.append(
            f'It leads the runner-up, "{ranked.iloc[1]["document"]}", by {margin:.3f} '
            f"({score:.3f} against {second:.3f}): {size}."
        )
    if shared[0]:
        quoted = ", ".join(f'"{w}"' for w in shared[0])
        also = [doc for doc, s in zip(ranked["document"][1:], shared[1:], strict=True) if s]
        word_search = (
            "A plain word search would have found it too: no other passage shares a word with "
            "the question."
            if not also
            else f"{len(also)} other passage{' shares' if len(also) == 1 else 's share'} a word "
            "with the question as well."
        )
        lines.append(
            f"It shares {quoted} with the question (stop words aside), so this ranking does not "
            f"show a search that finds a passage without a common word. {word_search}"
        )
    else:
        lines.append(
            "It shares no word with the question (stop words aside): the model matched the "
            "meaning, not the words."
        )
    return Conclusion(table, figures, "\n".join(lines))


def plan_in_words(table: pd.DataFrame, fallback: str | None = None) -> str:
    """Why each model of a memory plan was loaded, replaced or refused, one sentence per model.

    ``table`` is :attr:`labkit.capacity.Plan.table` (one row per model: ``needed (GiB)``,
    ``free before (GiB)``, ``device``, ``decision``, ``serve as``); ``fallback`` is the model the
    plan was given to serve instead of one that does not fit.
    """
    needed = {"needed (GiB)", "free before (GiB)", "device", "decision", "serve as"}
    if not needed <= set(table.columns):
        raise ConfigError(
            f"plan_in_words() needs a capacity plan's table, with {sorted(needed)}; got "
            f"columns {list(table.columns)}"
        )
    served = {str(name) for name in table["serve as"] if name}
    lines = []
    for model, row in table.iterrows():
        memory = "the GPU's memory" if row["device"] == "gpu" else "this host's memory"
        need, free = float(row["needed (GiB)"]), float(row["free before (GiB)"])
        too_big = (
            f"it needs about {need:.1f} GiB and only {free:.1f} GiB of {memory} was left for it"
        )
        decision = str(row["decision"])
        if decision == "fits":
            lines.append(
                f"{model} is loaded: it needs about {need:.1f} GiB of the {free:.1f} GiB left."
            )
        elif decision.startswith("replaced by "):
            lines.append(f"{model} is too big to load here ({too_big}): {decision}.")
        elif decision.startswith("fallback for "):
            lines.append(f"{model} takes its place: it needs about {need:.1f} GiB.")
        elif fallback and fallback in served:
            lines.append(
                f"{model} is not loaded: it is too big ({too_big}), and the fallback, {fallback}, "
                "is already served, so a second copy of it would only repeat the same answers."
            )
        elif fallback:
            lines.append(
                f"{model} is not loaded: it is too big ({too_big}), and the fallback, {fallback}, "
                "does not fit either."
            )
        else:
            lines.append(
                f"{model} is not loaded: it is too big ({too_big}), and no fallback is set."
            )
    return "\n".join(lines)


#: Columns of :mod:`labkit.capacity`'s tables whose names say less than they should to a learner.
PLAN_WORDS = {
    "count from": "parameters counted from",
    "resident (GiB)": "resident host memory (GiB)",
    "gpu (GiB)": "GPU memory (GiB)",
}


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A capacity plan's or memory comparison's table as a learner reads it: its terse column
    names in words (:data:`PLAN_WORDS`), and yes or no instead of True or False."""
    shown = frame.rename(columns=PLAN_WORDS)
    for column in shown.columns:
        if shown[column].dtype == bool:
            shown[column] = shown[column].map({True: "yes", False: "no"})
    return shown
