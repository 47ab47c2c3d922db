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
    """Notebook 00: how many checks passed, what warned, and whether the lab can start.

    ``checks`` is :func:`labkit.doctor.to_frame`'s table (a ``check`` and a ``status`` column).
    """
    if checks.empty or not {"check", "status"} <= set(checks.columns):
        raise ConfigError("setup_takeaway() needs doctor.to_frame()'s table of checks")
    by = {s: list(checks.loc[checks["status"] == s, "check"]) for s in ("ok", "warn", "fail")}
    lines = [
        f"{len(by['ok'])} of {len(checks)} checks passed, {len(by['warn'])} warned, "
        f"{len(by['fail'])} failed."
    ]
    lines.append(
        f"Warned: {_names(by['warn'])}; each row above says what the lab does without it."
        if by["warn"]
        else "Nothing warned: every optional tool and resource was found."
    )
    lines.append(
        f"Fix first, as each row's fix says: {_names(by['fail'])}."
        if by["fail"]
        else "Nothing failed: this machine can run the lab's notebooks."
    )
    return Takeaway(tuple(lines))


def deploy_takeaway(
    model: str,
    prompt: str,
    answer: str,
    agreed: Sequence[str],
    ttft_s: float,
    tokens_per_s: float,
    *,
    greedy: bool = True,
) -> Takeaway:
    """Notebook 01: what the served model answered, over which ways it agreed, and its stream.

    ``agreed`` names the ways of asking that returned ``answer`` (``"HTTP infer"``, ...).
    """
    if not agreed:
        raise ConfigError("deploy_takeaway() needs the ways of asking that returned the answer")
    same = (
        f"The same answer came back over {_names(agreed)}: greedy decoding gives one answer."
        if greedy and len(agreed) > 1
        else f"Asked over {_names(agreed)}; with sampling, answers differ from call to call."
        if not greedy
        else f"Asked over {agreed[0]}."
    )
    return Takeaway(
        (
            f'Triton served {model}: "{prompt}" was answered "{answer.strip()}".',
            same,
            f"Streamed, the first token came after {ttft_s:.2f} s, then {tokens_per_s:.1f} "
            "tokens/s.",
        )
    )


def multi_model_takeaway(served: Sequence[str], searches: Sequence[Conclusion]) -> Takeaway:
    """Notebook 02: how many models one server held, and what each semantic search showed.

    ``searches`` are :func:`labkit.lessons.search_conclusion` results (at most two are kept).
    """
    if not served:
        raise ConfigError("multi_model_takeaway() needs the models the server held")
    lines = [f"One server held {len(served)} models ({_names(served)})."]
    for search in searches[: MAX_LINES - 1]:
        f = search.figures
        how = (
            f"sharing {_names([repr(w) for w in f['shared_words']])} with the question"
            if f.get("shared_words")
            else "sharing no word with the question: found by meaning"
        )
        lead = f", {f['margin']:.3f} ahead of the next" if "margin" in f else ""
        lines.append(f'Search ranked "{f["winner"]}" first (score {f["winner_score"]:.3f}{lead}), '
                     f"{how}.")  # fmt: skip
    return Takeaway(tuple(lines))
