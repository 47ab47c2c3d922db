"""Notebook 02's figures: the words a ranking's winner shares with the question, its lead over the
runner-up, how many copies of a model fit in memory, and capacity tables in words."""

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


def test_a_winner_sharing_a_word_names_it_and_the_lead_is_between_the_scores_as_shown():
    hits = ranking({STATION: 0.391606, BUS: 0.364474, BAKERY: 0.129624})
    conclusion = lessons.search_conclusion("Where can I catch a train?", hits)
    assert conclusion.figures == {
        "question": "Where can I catch a train?", "winner": STATION, "winner_score": 0.392,
        "shared_words": ["train"], "margin": 0.028,
    }  # fmt: skip
    assert list(conclusion.table["words shared with the question"]) == ["train", "", ""]
    assert list(conclusion.table["similarity (cosine)"]) == [0.392, 0.364, 0.13]
    assert list(conclusion.table.columns[:2]) == ["passage", "similarity (cosine)"]
    assert "0.028 ahead" in conclusion.text and "question: train." in conclusion.text


def test_a_winner_sharing_no_word_says_none():
    hits = ranking({BAKERY: 0.466, STATION: 0.128, BUS: 0.102})
    conclusion = lessons.search_conclusion("Where can I buy something for breakfast?", hits)
    assert conclusion.figures["shared_words"] == []
    assert conclusion.figures["margin"] == 0.338
    assert conclusion.text.endswith("question: none.")


def test_every_passage_sharing_a_word_shows_it():
    hits = ranking({STATION: 0.5, "A train museum.": 0.3, BAKERY: 0.1})
    conclusion = lessons.search_conclusion("Which train goes to the airport?", hits)
    assert conclusion.figures["shared_words"] == ["airport", "train"]
    assert list(conclusion.table["words shared with the question"]) == [
        "airport, train",
        "train",
        "",
    ]


def test_one_passage_has_no_runner_up():
    conclusion = lessons.search_conclusion("bread?", ranking({BAKERY: 0.4}))
    assert "margin" not in conclusion.figures and "ahead" not in conclusion.text
    assert conclusion.figures["shared_words"] == ["bread"]


def test_words_are_compared_without_case_punctuation_plurals_or_stop_words():
    assert normalize("Trains.") == "train"
    assert [normalize(w) for w in ("libraries", "stops", "boxes", "bus", "class")] == [
        "library", "stop", "box", "bus", "class",
    ]  # fmt: skip
    assert content_words("Where can I catch a train?") == {"catch", "train"}


def test_a_ranking_without_scores_is_refused():
    with pytest.raises(ConfigError, match="'document' and a 'score' column"):
        lessons.search_conclusion("q", pd.DataFrame({"document": ["a"]}))


@pytest.mark.parametrize(
    ("available", "measured", "copies", "shown"),
    [(22.8347, 1.1312, 20, "22.83 / 1.131 = 20.18"), (21.3, 0.426, 50, "21.30 / 0.426 = 50.00"),
     (22.76, 0.414, 54, "22.76 / 0.414 = 54.97"), (1.0, 1.2, 0, "1.00 / 1.200 = 0.83")],
    ids=["smollm2", "exactly", "just-under", "none"],
)  # fmt: skip
def test_how_many_copies_fit_is_the_available_memory_over_one_copy_rounded_down(
    available, measured, copies, shown
):
    fit = search.how_many_fit(pd.Series({"smollm2": measured}), available).loc["smollm2"]
    assert fit["copies that fit"] == copies and fit["available / one copy"] == shown


def test_a_model_not_measured_on_the_device_is_not_counted():
    fits = search.how_many_fit(pd.Series({"a": 0.5, "cpu-kind": 0.0, "gone": float("nan")}), 2)
    assert list(fits.index) == ["a"] and list(fits.columns)[-1] == "copies that fit"
    assert search.how_many_fit(pd.Series(dtype=float), 2).empty


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
