"""A notebook's last word (:class:`Takeaway`): at most three short lines of figures and verdicts.
A :class:`Conclusion` carries its own; 00, 01 and 02 judge no comparison and get theirs here."""

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
#: A quoted question or passage, which is part of the sentence that quotes it.
_QUOTED = re.compile(r'"[^"]*"')


def sentence_count(lines: Iterable[str]) -> int:
    """How many sentences ``lines`` hold together (a line that ends without a stop is one)."""
    plain = [_QUOTED.sub('""', str(line)).strip() for line in lines]
    return sum(len([s for s in _SENTENCE_END.split(line) if s]) for line in plain)


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
    """Notebook 00: ready or not, the count of each status, then the checks that failed, warned
    and were skipped, by name (``checks`` is :func:`labkit.doctor.to_frame`'s table)."""
    if checks.empty or not {"check", "status"} <= set(checks.columns):
        raise ConfigError("setup_takeaway() needs doctor.to_frame()'s table of checks")
    by = {s: list(checks.loc[checks["status"] == s, "check"]) for s in STATUSES}
    counts = ", ".join(f"{len(by[s])} {s}" for s in STATUSES)
    lines = [f"{'Not ready' if by['fail'] else 'Ready'}: of {len(checks)} checks, {counts}."]
    lines += [f"{said}: {_names(by[s])}." for s, said in STATUSES.items() if said and by[s]]
    return Takeaway(tuple(lines[:MAX_LINES]))


#: A check's statuses, in the takeaway's order, and how it names the checks that ended in each.
STATUSES = {"ok": "", "fail": "Failed", "warn": "Warned", "skipped": "Skipped"}


def deploy_takeaway(
    model: str,
    answers: dict[str, str],
    ttft_s: float,
    tokens_per_s: float,
    *,
    model_py_lines: int,
    stream_model: str,
) -> Takeaway:
    """Notebook 01: what serving took, whether every way of asking (``answers``, each held to the
    first one's text) got the same greedy answer, and the stream's two figures."""
    if not answers:
        raise ConfigError("deploy_takeaway() needs the answers, by the way each was asked")
    first = next(iter(answers.values()))
    differed = [way for way, text in answers.items() if text != first]
    same = (
        f"Answers differed: {_names(differed)} against {next(iter(answers))}."
        if differed
        else f"Same greedy answer by all {len(answers)} ways of asking ({_names(answers)})."
    )
    stream = f"first token after {ttft_s:.2f} s, then {tokens_per_s:.1f} tokens/s"
    served = f"Serving {model}: a config.pbtxt and a {model_py_lines}-line model.py."
    return Takeaway((served, same, f"Streamed by {stream_model}: {stream}."))


def multi_model_takeaway(
    served: Sequence[str],
    *,
    held_gib: float,
    estimated_gib: float,
    fit: pd.Series | None = None,
    live: tuple[str, str] | None = None,
    search: Conclusion | None = None,
) -> Takeaway:
    """Notebook 02: how many copies of a model fit (``fit``, a row of
    :func:`~labkit.lessons.search.how_many_fit`), the served models' memory, what changed live
    (``live``: the model reloaded, the one reconfigured), and one search's figures."""
    if not served:
        raise ConfigError("multi_model_takeaway() needs the models the server held")
    lines = []
    if fit is not None:
        lines.append(
            f"Copies of {fit.name} that fit in memory: {fit['copies that fit']} "
            f"({fit['available / one copy']})."
        )
    changed = f"; {live[0]} reloaded and {live[1]} reconfigured live" if live else ""
    lines.append(
        f"One server held {_names(served)}: {held_gib:.2f} GiB measured against "
        f"{estimated_gib:.2f} GiB estimated{changed}."
    )
    if search is not None:
        f = search.figures
        lead = f", {f['margin']:.3f} ahead" if "margin" in f else ""
        words = _names(f["shared_words"]) or "no word"
        lines.append(f'Search: "{f["question"]}" ranked "{f["winner"]}" first '
                     f"({f['winner_score']:.3f}{lead}), sharing {words} with the question.")  # fmt: skip
    return Takeaway(tuple(lines))
