"""A checkpoint's header is checked field by field before the commands read it (flowvm.persist.headers)."""

from __future__ import annotations

import pytest

from flowvm import CheckpointError
from flowvm.persist.headers import check_header

GOOD = {"format": 3, "flowvm": "0.3.0", "python": "3.11.7", "created": "2026-11-27T08:00:00+0000", "steps": 5,
        "done": False, "program": "SEQ", "position": "0.1", "signed": False, "settings": {},
        "meta": {"target": "pca", "module": "flowvm.programs.pca", "sets": ["components=2"], "show": ["loss"],
                 "data": "/data/x.npy", "every": 10, "every_seconds": 60.0, "threads": None,
                 "history": {"names": ["loss"], "points": {"loss": [[1, 0.5], [2, None], [3, [1.0, None]]]},
                             "every": 1, "auto": True}}}


def test_a_header_as_flowvm_writes_it_passes():
    assert check_header(GOOD, "run.ckpt") is GOOD
    assert check_header({}, "run.ckpt") == {}  # fields not there are not checked


@pytest.mark.parametrize("change, field, expected", [
    (lambda h: h.update(flowvm=3), "flowvm", "a string of at most 200 characters"),
    (lambda h: h.update(created="x" * 201), "created", "a string"),
    (lambda h: h.update(steps=-1), "steps", "an int >= 0"),
    (lambda h: h.update(steps=True), "steps", "an int >= 0"),
    (lambda h: h.update(done="no"), "done", "true or false"),
    (lambda h: h.update(signed=None), "signed", "true or false"),
    (lambda h: h.update(position=3), "position", "a path"),
    (lambda h: h.update(settings=[]), "settings", "an object"),
    (lambda h: h.update(meta=[1]), "meta", "an object"),
    (lambda h: h["meta"].update(target=["pca"]), "meta.target", "a string"),
    (lambda h: h["meta"].update(data=7), "meta.data", "a string"),
    (lambda h: h["meta"].update(sets=None), "meta.sets", "a list of strings"),
    (lambda h: h["meta"].update(show=[1]), "meta.show", "a list of strings"),
    (lambda h: h["meta"].update(every=0), "meta.every", "an int >= 1 or null"),
    (lambda h: h["meta"].update(threads=2.0), "meta.threads", "an int >= 1 or null"),
    (lambda h: h["meta"].update(every_seconds=float("inf")), "meta.every_seconds", "a number > 0"),
    (lambda h: h["meta"].update(search="x"), "meta.search", "an object"),
])
def test_a_field_not_as_flowvm_writes_it_is_named(change, field, expected):
    import copy

    header = copy.deepcopy(GOOD)
    change(header)
    with pytest.raises(CheckpointError, match=rf"the header's field '{field}' must be {expected}"):
        check_header(header, "run.ckpt")


@pytest.mark.parametrize("history, why", [
    ({"names": "loss", "points": {}, "every": 1}, "names"),
    ({"names": ["loss"], "points": {}, "every": 1}, "points: an object"),
    ({"names": ["loss"], "points": {"loss": []}, "every": 0}, "every"),
    ({"names": ["loss"], "points": {"loss": []}, "every": 1, "auto": 1}, "auto"),
    ({"names": ["loss"], "points": {"loss": [[1, "x"]]}, "every": 1}, "points of 'loss'"),
    ({"names": ["loss"], "points": {"loss": [[1.5, 2.0]]}, "every": 1}, "points of 'loss'"),
    ({"names": ["loss"], "points": {"loss": [[1, [1.0, "x"]]]}, "every": 1}, "points of 'loss'"),
    ({"names": ["loss"]}, "'points'"),
])
def test_a_history_not_as_flowvm_writes_it_is_refused(history, why):
    with pytest.raises(CheckpointError, match=rf"'meta.history' is not as flowvm writes it \(.*{why}"):
        check_header({"meta": {"history": history}}, "run.ckpt")
