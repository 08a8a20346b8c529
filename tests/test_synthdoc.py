"""Synthetic forms and request streams: deterministic, answers known, variants what they claim."""

import random

import numpy as np
import pytest
from PIL import Image

from vismemo_hf.eval import synthdoc
from vismemo_hf.eval.quality import anls


def test_stream_is_deterministic_and_mixes_hit_kinds():
    a, b = synthdoc.stream(7, n_bases=10), synthdoc.stream(7, n_bases=10)
    assert [r.id for r in a] == [r.id for r in b] and [r.answers for r in a] == [r.answers for r in b]
    kinds = {k: sum(r.intended == k for r in a) for k in ("miss", "exact", "approximate")}
    assert kinds["miss"] == 10 and kinds["exact"] > 0 and kinds["approximate"] > kinds["exact"]
    variants = {r.variant for r in a}
    assert set(synthdoc.VARIANTS) | {f"base-{s}" for s in synthdoc.STYLES} <= variants
    for r in a:
        assert (r.variant == "prefix") == bool(r.prefix) and (r.intended == "exact") == (r.variant in ("same", "prefix"))
    seen = set()
    for r in a:  # a follow-up always comes after its base page
        base_id = r.id.split("v")[0]
        assert r.intended == "miss" or base_id in seen
        seen.add(r.id)


def test_edited_value_questions_have_a_stale_answer_that_differs_everywhere():
    edits = [r for r in synthdoc.stream(3, n_bases=15) if r.about_edit]
    assert edits
    for r in edits:
        assert r.stale is not None and len(r.stale) == len(r.answers[0]) == 4
        assert all(x != y for x, y in zip(r.stale, r.answers[0]))
        assert anls(r.stale, r.answers) == 0.0


@pytest.mark.parametrize("style", synthdoc.STYLES)
def test_every_glyph_is_drawn_inside_its_own_cell(style):
    """Glyphs are black and stay in their cells; what a page type adds is lighter and never inside a glyph cell."""
    page = synthdoc.shift(synthdoc.random_form(5, style=style), 2, -2)
    img = np.asarray(synthdoc.render(page).convert("L"))
    for i, ch in enumerate(page.cell_text()):
        r, c = divmod(i, synthdoc.COLS)
        cell = img[r * synthdoc.CELL:(r + 1) * synthdoc.CELL, c * synthdoc.CELL:(c + 1) * synthdoc.CELL]
        assert (cell.min() < 64) == (ch != " "), (style, i, ch)
    if style != "form":  # the page type is visible
        plain = np.asarray(synthdoc.render(synthdoc.shift(synthdoc.random_form(5), 2, -2)).convert("L"))
        assert np.abs(img.astype(int) - plain).max() > 40


def test_page_types_and_changed_widgets():
    with pytest.raises(ValueError, match="page type"):
        synthdoc.random_form(1, style="poster")
    ui = synthdoc.random_form(4, style="ui")
    switched = synthdoc.toggle_light(ui, 3)
    assert switched.rows == ui.rows and switched.lights[3] != ui.lights[3]
    diff = np.abs(np.asarray(synthdoc.render(switched), dtype=np.int16) - np.asarray(synthdoc.render(ui), dtype=np.int16))
    rows, cols = np.nonzero(diff.max(-1))
    assert rows.min() // synthdoc.CELL == rows.max() // synthdoc.CELL == 3  # only row 3's light changed
    assert cols.min() // synthdoc.CELL == cols.max() // synthdoc.CELL == synthdoc.VALUE_COL - 1
    with pytest.raises(ValueError):
        synthdoc.toggle_light(synthdoc.random_form(4), 0)


def test_variants_change_pixels_but_not_the_answers():
    page = synthdoc.random_form(9)
    base = np.asarray(synthdoc.render(page), dtype=np.int16)
    for variant in (synthdoc.shift(page, 2), synthdoc.reencode(page), synthdoc.brighten(page)):
        assert variant.rows == page.rows
        assert np.abs(np.asarray(synthdoc.render(variant), dtype=np.int16) - base).max() > 0
    edited = synthdoc.edit_value(page, 2, random.Random(0))
    assert edited.rows[2][0] == page.rows[2][0] and edited.rows[2][1] != page.rows[2][1]


@pytest.mark.parametrize("pred,answers", [("1234", ["1234"]), ("1235", ["1234"]), (" 12 34 ", ["1234"]),
                                          ("abc", ["ABC", "x"]), ("", ["1234"]), ("12", ["1234"]),
                                          ("Dollars 12", ["12 dollars", "$12"])])
def test_anls_is_lmms_evals(pred, answers):
    from lmms_eval.api.metrics import anls as reference

    assert anls(pred, answers) == pytest.approx(reference(answers, [pred])["anls"])


def test_real_page_streams_and_parquet(tmp_path):
    pages = [(f"doc{i}", Image.new("RGB", (64, 48), (255, 255 - i, 255)), [(f"q{i}{j}", [f"a{i}{j}"]) for j in range(3)])
             for i in range(4)]
    rows = synthdoc.page_stream(pages, seed=1)
    kinds = [r["intended"] for r in rows]
    assert len(rows) == 20 and (kinds.count("miss"), kinds.count("exact"), kinds.count("approximate")) == (4, 4, 12)
    for r in rows:  # every copy keeps the answers of the page's question it asks
        page = int(r["id"].split("/")[0][3:])
        assert r["answers"] == [f"a{page}{r['question'][-1]}"]
    assert {r["variant"] for r in rows if r["intended"] == "approximate"} == set(synthdoc.COPIES)
    order = [r["id"] for r in rows]
    for r in rows:
        assert order.index(r["id"].split("/")[0] + "/0") <= order.index(r["id"])
    import datasets

    path = synthdoc.save_rows(rows, tmp_path / "s.parquet")
    back = datasets.load_dataset("parquet", data_files={"test": path}, split="test")
    assert back[0]["id"] == rows[0]["id"] and back[0]["image"].size == (64, 48)
