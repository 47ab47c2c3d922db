"""What every lesson shows a learner: nothing internal in its outputs, and a short takeaway."""

from __future__ import annotations

import nbformat
import pytest

from labkit.shown import internal_outputs, not_for_a_learner


def executed(*outputs: dict) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), cell])


def stream(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def shown(data: dict) -> dict:
    return {"output_type": "display_data", "data": data, "metadata": {}}


@pytest.mark.parametrize(
    "text",
    [
        "vllm_served_vs_standalone_c4_mixed  1.13",
        "Ratio(value=1.2, of='infer/s')",
        "<Conclusion(table=...)>",
        "target >= 1.5, measured 1.132, met: no",
        "ITL p50: not measured",
    ],
)
def test_a_benchmark_key_a_repr_or_a_target_verdict_in_a_printed_line_is_found(text):
    found = internal_outputs(executed(stream(f"first line\n{text}\nlast line")))
    assert found == [(1, text)]


def test_an_html_table_is_read_but_the_scripts_of_a_page_are_not():
    page = "<script>var x={met:1,a_vs_b:2}</script><table><td>in-flight_vs_vllm</td></table>"
    found = internal_outputs(executed(shown({"text/html": page, "text/plain": "<Styler>"})))
    assert [cell for cell, _ in found] == [1] and "in-flight_vs_vllm" in found[0][1]


def test_a_charts_trace_names_and_titles_are_read_and_its_numbers_are_not():
    chart = {"data": [{"name": "vLLM", "y": [1, 2]}], "layout": {"title": {"text": "tokens/s"}}}
    assert internal_outputs(executed(shown({"application/vnd.plotly.v1+json": chart}))) == []
    chart["layout"]["title"]["text"] = "inflight_vs_vllm"
    assert len(internal_outputs(executed(shown({"application/vnd.plotly.v1+json": chart})))) == 1


def test_stderr_errors_and_internal_text_are_listed_together_in_cell_order():
    nb = executed(stream("a_vs_b 1.2"))
    warned = nbformat.v4.new_code_cell("y")
    warned.outputs = [
        nbformat.from_dict({"output_type": "stream", "name": "stderr", "text": "UserWarning: x"}),
        nbformat.from_dict({"output_type": "error", "ename": "ValueError", "evalue": "bad"}),
    ]
    nb.cells.insert(1, warned)
    assert not_for_a_learner(nb) == [
        (1, "stderr: UserWarning: x"),
        (1, "error: ValueError: bad"),
        (2, "internal text a learner should not read: a_vs_b 1.2"),
    ]


def test_plain_words_pass():
    words = "vLLM served 2.5x the tokens/s of the lab's model; the comparison met its aim."
    assert internal_outputs(executed(stream(words))) == []


def test_a_takeaway_of_more_than_three_sentences_in_all_is_refused():
    from labkit.errors import ConfigError
    from labkit.lessons import Takeaway
    from labkit.lessons.takeaway import sentence_count

    assert sentence_count(["vLLM served 1.73x the tokens/s, at 0.5 ms a step.", "Done"]) == 2
    Takeaway(("One. Two.", "Three."))
    with pytest.raises(ConfigError, match="at most 3 plain sentences in all, got 4"):
        Takeaway(("One. Two.", "Three. Four."))
