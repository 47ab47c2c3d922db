"""A notebook's last word: three lines, each computed from what the notebook measured.

Notebooks 03 to 07 end on a :class:`~labkit.lessons.conclusion.Conclusion`, which carries its
takeaway; 00, 01 and 02 measure no comparison, and their takeaways are made here from what they
checked and served. :func:`labkit.lab.takeaway` shows one at a notebook's end and keeps it for the
run's ``index.html``.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from labkit.errors import ConfigError
from labkit.lessons.conclusion import Conclusion

#: The most lines a takeaway has: what the index shows beside the notebook's figures.
MAX_LINES = 3
#: The most sentences a takeaway has, all its lines together: three plain sentences.
MAX_SENTENCES = 3

#: Where one sentence ends and the next begins: a full stop, "!" or "?" before a space. A decimal
#: point (``0.5``, ``x1.82``) has no space after it and does not end a sentence.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentence_count(lines: Iterable[str]) -> int:
    """How many sentences ``lines`` hold together (a line that ends without a stop is one)."""
    return sum(len([s for s in _SENTENCE_END.split(str(line).strip()) if s]) for line in lines)


@dataclass(frozen=True, repr=False)
class Takeaway:
    """One to three lines, at most three sentences in all: what a learner keeps."""

    lines: tuple[str, ...]

    def __post_init__(self) -> None:
        lines = tuple(str(line).strip() for line in self.lines)
        if not 1 <= len(lines) <= MAX_LINES or not all(lines):
            raise ConfigError(
                f"a takeaway is 1 to {MAX_LINES} non-empty lines, got {len(lines)}: {lines!r}"
            )
        if sentence_count(lines) > MAX_SENTENCES:
            raise ConfigError(
                f"a takeaway is at most {MAX_SENTENCES} plain sentences in all, got "
                f"{sentence_count(lines)}: {lines!r}"
            )
        object.__setattr__(self, "lines", lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def __repr__(self) -> str:  # a notebook's text output
        return "Takeaway:\n" + "\n".join(f"{i}. {line}" for i, line in enumerate(self.lines, 1))

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines)
        return f"<p><b>Takeaway</b></p><ol>{items}</ol>"

    @staticmethod
    def of(what: Takeaway | Conclusion | Iterable[str]) -> Takeaway:
        """A takeaway from a conclusion (its own), a takeaway, or lines."""
        if isinstance(what, Takeaway):
            return what
        if isinstance(what, Conclusion):
            if not what.takeaway:
                raise ConfigError("this conclusion carries no takeaway")
            return Takeaway(tuple(what.takeaway))
        if isinstance(what, str):
            return Takeaway((what,))
        return Takeaway(tuple(what))


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def setup_takeaway(checks: pd.DataFrame) -> Takeaway:
    """Notebook 00: whether the lab can start, what warned, and which checks did not run.

    ``checks`` is :func:`labkit.doctor.to_frame`'s table (a ``check`` and a ``status`` column:
    ``ok``, ``warn``, ``fail`` or ``skipped``). A skipped check is counted apart, never as passed.
    """
    if checks.empty or not {"check", "status"} <= set(checks.columns):
        raise ConfigError("setup_takeaway() needs doctor.to_frame()'s table of checks")
    by = {
        s: list(checks.loc[checks["status"] == s, "check"])
        for s in ("ok", "warn", "fail", "skipped")
    }
    verdict = (
        f"fix {_names(by['fail'])} first, as their rows say."
        if by["fail"]
        else "this machine can run the lab's notebooks."
    )
    lines = [
        f"{len(by['ok'])} of {len(checks)} checks passed and {len(by['fail'])} failed: {verdict}"
    ]
    if by["warn"]:
        lines.append(
            f"{len(by['warn'])} warned ({_names(by['warn'])}): each row says what the lab does "
            "without it."
        )
    if by["skipped"]:
        lines.append(
            f"{len(by['skipped'])} did not run ({_names(by['skipped'])}): their rows say why."
        )
    return Takeaway(tuple(lines))


def deploy_takeaway(
    model: str,
    answers: dict[str, str],
    ttft_s: float,
    tokens_per_s: float,
    *,
    model_py_lines: int,
    stream_model: str,
) -> Takeaway:
    """Notebook 01: what serving a model took, whether every way of asking got the same greedy
    answer, and how fast the answer streamed.

    ``answers`` maps each way of asking (``"HTTP infer"``, ...) to the text it returned; the
    first is the one the others are held to. ``model_py_lines`` counts the served ``model.py``.
    """
    if not answers:
        raise ConfigError("deploy_takeaway() needs the answers, by the way each was asked")

    def listed(ways: list[str]) -> str:
        return ways[0] if len(ways) == 1 else f"{', '.join(ways[:-1])} and {ways[-1]}"

    first = next(iter(answers.values()))
    agreed = [way for way, text in answers.items() if text == first]
    differed = [way for way in answers if way not in agreed]
    same = (
        f"{listed(differed)} returned another answer than {listed(agreed)}, which greedy "
        "decoding should never do: compare them in the cells above."
        if differed
        else f"Greedy decoding picks the likeliest next token each time, so {listed(agreed)} "
        "all returned the same answer."
    )
    return Takeaway(
        (
            f"Serving {model} took a folder with a config.pbtxt and a {model_py_lines}-line "
            "model.py, whose initialize loads the model and whose execute answers each request.",
            same,
            f"Streamed token by token by {stream_model}, the first token came after "
            f"{ttft_s:.2f} s, then {tokens_per_s:.1f} tokens/s.",
        )
    )


def multi_model_takeaway(
    served: Sequence[str],
    searches: Sequence[Conclusion],
    *,
    measured_gib: float | None = None,
    estimated_gib: float | None = None,
    live: tuple[str, str] | None = None,
    free_gib: float | None = None,
) -> Takeaway:
    """Notebook 02: how many models one server held (and in how much memory), what changed
    while it served, and what each semantic search showed: a passage found by meaning, or one
    that shares a word.

    ``searches`` are :func:`labkit.lessons.search_conclusion` results (at most two are kept, one
    when ``live`` is given: the notebook's question is what fits and what can change, so those
    come first); ``measured_gib`` and ``estimated_gib`` are the models' resident memory together
    and the plan's estimate (:meth:`labkit.capacity.Plan.compare`); ``live`` names the model
    unloaded and reloaded and the one whose configuration was edited and reloaded; ``free_gib``,
    the memory the plan found free, answers the notebook's question: how many fit.
    """
    if not served:
        raise ConfigError("multi_model_takeaway() needs the models the server held")
    memory = (
        f", in {measured_gib:.2f} GiB of memory against the {estimated_gib:.2f} GiB estimated"
        if measured_gib is not None and estimated_gib is not None
        else ""
    )
    if memory and free_gib is not None:
        memory += (
            f", out of {free_gib:.1f} GiB free: as many models fit as their estimates add up to "
            "within the free memory"
        )
    held = f"{len(served)} model{'s' if len(served) != 1 else ''} ({_names(served)})"
    lines = [f"One server held {held}, each in its own process{memory}."]
    if live is not None:
        unloaded, edited = live
        lines.append(
            f"{unloaded} was unloaded and loaded again, and {edited}'s configuration edited and "
            "reloaded, without restarting the server or the other models."
        )
    for search in searches[len(lines) - MAX_LINES :]:
        f = search.figures
        asked = f'Asked "{f["question"]}", the search' if f.get("question") else "The search"
        lead = f", {f['margin']:.3f} ahead of the next" if "margin" in f else ""
        how = (
            "sharing the word "
            + _names([f'"{w}"' for w in f["shared_words"]])
            + " with the question, so a word search finds it too"
            if f.get("shared_words")
            else "sharing no word with the question: it was found by meaning"
        )
        lines.append(f'{asked} ranked "{f["winner"]}" first (score {f["winner_score"]:.3f}{lead}), '
                     f"{how}.")  # fmt: skip
    return Takeaway(tuple(lines))
