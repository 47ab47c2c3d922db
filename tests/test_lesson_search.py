"""Notebook 02's search lesson says what the ranking shows: the "no shared word" claim only when
the winning passage shares no word with the question, and a small lead called small."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import lessons
from labkit.errors import ConfigError
from labkit.lessons import search
from labkit.lessons.search import content_words, normalize

STATION = "The central station has trains to the airport every ten minutes."
BAKERY = "Our bakery sells fresh bread and croissants every morning."
BUS = "Bus line 4 stops in front of the library."


def ranking(scores: dict[str, float]) -> pd.DataFrame:
    """Passages and scores as :func:`labkit.embedding.search` returns them, best first."""
    frame = pd.DataFrame({"document": list(scores), "score": list(scores.values())})
    return frame.sort_values("score", ascending=False, ignore_index=True)


def test_a_winner_sharing_a_word_is_not_said_to_share_none():
    hits = ranking({STATION: 0.392, BUS: 0.364, BAKERY: 0.130})
    conclusion = lessons.search_conclusion("Where can I catch a train?", hits)
    assert conclusion.figures["shared_words"] == ["train"]
    assert conclusion.figures["margin"] == 0.028
    assert conclusion.figures["question"] == "Where can I catch a train?"
    assert 'It shares "train" with the question' in conclusion.text
    assert "shares no word" not in conclusion.text
    assert "by 0.028 (0.392 against 0.364): a small lead" in conclusion.text
    assert "A plain word search would have found it too" in conclusion.text
    assert list(conclusion.table["words shared with the question"]) == ["train", "", ""]


def test_a_winner_sharing_no_word_is_said_to_and_a_clear_lead_is_not_called_small():
    hits = ranking({BAKERY: 0.466, STATION: 0.128, BUS: 0.102})
    conclusion = lessons.search_conclusion("Where can I buy something for breakfast?", hits)
    assert conclusion.figures["shared_words"] == []
    assert "It shares no word with the question (stop words aside)" in conclusion.text
    assert "a clear lead" in conclusion.text and "small lead" not in conclusion.text
    assert f'"{BAKERY}" (score 0.466)' in conclusion.text


def test_other_passages_sharing_a_word_are_counted():
    hits = ranking({STATION: 0.5, "A train museum.": 0.3, BAKERY: 0.1})
    conclusion = lessons.search_conclusion("Which train goes to the airport?", hits)
    assert conclusion.figures["shared_words"] == ["airport", "train"]
    assert "1 other passage shares a word with the question as well" in conclusion.text


def test_one_passage_has_no_runner_up():
    conclusion = lessons.search_conclusion("bread?", ranking({BAKERY: 0.4}))
    assert "margin" not in conclusion.figures and "runner-up" not in conclusion.text
    assert 'It shares "bread"' in conclusion.text


def test_words_are_compared_without_case_punctuation_plurals_or_stop_words():
    assert normalize("Trains.") == "train"
    assert [normalize(w) for w in ("libraries", "stops", "boxes", "bus", "class")] == [
        "library", "stop", "box", "bus", "class",
    ]  # fmt: skip
    assert content_words("Where can I catch a train?") == {"catch", "train"}


def test_a_ranking_without_scores_is_refused():
    with pytest.raises(ConfigError, match="'document' and a 'score' column"):
        lessons.search_conclusion("q", pd.DataFrame({"document": ["a"]}))


def test_the_lead_is_taken_between_the_scores_as_quoted():
    hits = ranking({STATION: 0.391606, BUS: 0.364474, BAKERY: 0.129624})
    conclusion = lessons.search_conclusion("Where can I catch a train?", hits)
    assert "by 0.028 (0.392 against 0.364)" in conclusion.text
    assert list(conclusion.table["similarity (cosine)"]) == [0.392, 0.364, 0.13]
    assert list(conclusion.table.columns[:2]) == ["passage", "similarity (cosine)"]


def plan_table(*rows: tuple[str, float, float, str, str]) -> pd.DataFrame:
    """A capacity plan's table: model, needed and free GiB, decision, served as."""
    frame = pd.DataFrame(
        rows, columns=["model", "needed (GiB)", "free before (GiB)", "decision", "serve as"]
    )
    return frame.assign(device="cpu").set_index("model")


def test_a_refused_model_is_said_to_be_too_big_and_why_the_fallback_does_not_stand_in():
    table = plan_table(
        ("falcon7b", 31.4, 22.6, "replaced by opt125m", ""),
        ("opt125m", 1.06, 22.6, "fallback for falcon7b", "opt125m"),
        ("persimmon8b", 42.5, 21.6, "refused", ""),
    )
    words = search.plan_in_words(table, fallback="opt125m").splitlines()
    assert words[0] == (
        "falcon7b is too big to load here (it needs about 31.4 GiB and only 22.6 GiB of this "
        "host's memory was left for it): replaced by opt125m."
    )
    assert (
        "persimmon8b is not loaded: it is too big (it needs about 42.5 GiB and only 21.6"
        in words[2]
    )
    assert "opt125m, is already served, so a second copy" in words[2]
    alone = plan_table(("persimmon8b", 42.5, 21.6, "refused", ""))
    assert "opt125m, does not fit either" in search.plan_in_words(alone, fallback="opt125m")
    assert "no fallback is set" in search.plan_in_words(alone)
    fits = search.plan_in_words(plan_table(("smollm2", 1.1, 22.6, "fits", "smollm2")))
    assert fits == "smollm2 is loaded: it needs about 1.1 GiB of the 22.6 GiB left."
    with pytest.raises(ConfigError, match="capacity plan's table"):
        search.plan_in_words(pd.DataFrame({"model": ["m"]}))


def test_capacity_tables_read_in_words_with_yes_and_no():
    frame = pd.DataFrame(
        {"estimated (GiB)": [0.6, 1.1], "gpu (GiB)": [0.0, 0.0], "within estimate": [True, False],
         "count from": ["checkpoint", "catalog"]},
        index=pd.Index(["minilm", "smollm2"], name="model"),
    )  # fmt: skip
    shown = search.readable(frame)
    assert list(shown.columns) == [
        "estimated (GiB)", "GPU memory (GiB)", "within estimate", "parameters counted from"
    ]  # fmt: skip
    assert list(shown["within estimate"]) == ["yes", "no"]
    assert list(frame["within estimate"]) == [True, False]  # the figures' own frame is untouched
