"""A model's calibrated context tolerance (``policies.tolerance``, ``vismemo calibrate --context``): a preset naming
the model's fingerprint changes the context routing of every cache that serves that model with its policy's own
default routing, and nothing else; the calibration keeps the routing that recomputes least among those that agree."""

import pytest
import yaml

import vismemo_hf
from vismemo_hf.bench import context as report
from vismemo_hf.families.base import model_fingerprint
from vismemo_hf.policies import tolerance

from conftest import build_inputs, generate, noise_image


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """An empty ``configs/context/`` in a working directory of its own (first on the presets' search path)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "configs" / "context"
    folder.mkdir(parents=True)
    tolerance.forget()
    yield folder
    tolerance.forget()


def _write(folder, name, data):
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(data))


def test_a_calibrated_model_is_served_with_its_tolerance_and_only_where_no_routing_was_given(qwen2, configs):
    model, processor = qwen2
    fingerprint = model_fingerprint(model)
    _write(configs, "other", {"fingerprint": "0" * 32, "context": {"small_change": 99}})
    _write(configs, "broken", {"fingerprint": fingerprint, "context": {"no_such_field": 1}})  # skipped, not fatal
    _write(configs, "mine", {"fingerprint": fingerprint, "context": {"small_change": 16, "check_large": True},
                             "calibration": {"routing": "small <= 16, larger checked"}})
    inputs = build_inputs(processor, [noise_image(3)])
    served = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore())
    assert served.policy.context.small_change == 8  # no model yet
    generate(model, inputs, served, 1)
    assert served.policy.context.small_change == 16 and served.policy.context.check_large
    assert served.given_policy.context.small_change == 8 and served.policy.name == served.given_policy.name
    given = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), context={"small_change": 4})
    paper = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), policy="vismemo")
    for cache in (given, paper):
        before = cache.policy
        generate(model, inputs, cache, 1)
        assert cache.policy is before, "a routing given, or one with no check, is kept as it is"
    tolerance.forget()
    (configs / "mine.yaml").unlink()
    (configs / "broken.yaml").unlink()
    later = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore())
    generate(model, inputs, later, 1)
    assert later.policy is later.given_policy, "without a calibration the safe default stays"


def test_malformed_context_presets_name_their_file(configs):
    for name, data, says in (("extra", {"fingerprint": "a" * 32, "tau": 1}, "unknown context preset key"),
                             ("unnamed", {"context": {}}, "names no model fingerprint"),
                             ("field", {"fingerprint": "a" * 32, "context": {"small_chang": 3}}, "no field"),
                             ("value", {"fingerprint": "a" * 32, "context": {"miss_ratio": 3.0}}, "miss_ratio")):
        _write(configs, name, data)
        with pytest.raises(ValueError, match=says) as err:
            tolerance.load(name)
        assert f"{name}.yaml" in str(err.value)
    assert tolerance.calibrated("a" * 32) is None


def _summary(agreement: dict, recomputed: dict, stale: dict | None = None) -> dict:
    return {cls: {label: {"agreement": agreement.get(label, 1.0), "recomputed_share": recomputed[label],
                          "stale": (stale or {}).get(label, 0)} for label in report.CANDIDATES}
            for cls in ("a", "b")}


def test_the_calibration_keeps_the_routing_that_recomputes_least_among_those_that_agree():
    labels = list(report.CANDIDATES)
    recomputed = {label: 1.0 - 0.1 * i for i, label in enumerate(labels)}
    recomputed[report.STRICTEST] = 1.0
    least = labels[len(labels) - 2]  # recomputes least of all, but disagrees
    chosen, figures = report.choose(_summary({least: 0.9}, recomputed), ("a", "b"), 0.98)
    assert chosen == labels[len(labels) - 3] and not figures[least]["passes"]
    chosen, _ = report.choose(_summary({}, recomputed, stale={least: 1}), ("a", "b"), 0.98)
    assert chosen == labels[len(labels) - 3], "a stale answer fails a routing whatever its agreement"
    assert report.choose(_summary({}, recomputed), ("a", "b"), 0.98)[0] == least
    same = {label: 0.5 for label in labels}
    assert report.choose(_summary({}, same), ("a", "b"), 0.98)[0] == report.DEFAULT_CANDIDATE, "the default on a tie"
    nobody = {label: 0.5 for label in labels}
    assert report.choose(_summary(nobody, same), ("a", "b"), 0.98)[0] == report.STRICTEST


def test_a_routing_that_fails_on_held_out_seeds_is_left_out(monkeypatch):
    """The calibration seed's choice is checked on held-out case seeds; one that fails there is replaced by the
    next, itself checked (the strictest routing agrees by construction)."""
    labels = list(report.CANDIDATES)
    recomputed = {label: 1.0 - 0.1 * i for i, label in enumerate(labels)}
    recomputed[report.STRICTEST] = 1.0
    lucky = labels[len(labels) - 2]  # the least recomputed: passes on the calibration seed alone
    calls = []

    def measure(model, seed, pairs, policies, classes, **_):
        calls.append((seed, tuple(policies)))
        bad = {lucky: 0.7} if seed != 100 else {}
        return [], {cls: {label: {"agreement": bad.get(label, 1.0), "recomputed_share": recomputed[label], "stale": 0}
                          for label in policies} for cls in classes}

    monkeypatch.setattr(report, "measure", measure)
    found = report.calibrate_context("m", 3, 100, 0.98, heldout=2)
    assert found["chosen"] == labels[len(labels) - 3] and found["options"] == report.CANDIDATES[found["chosen"]]["context"]
    assert not found["heldout"][lucky]["passes"] and found["heldout"][found["chosen"]]["passes"]
    assert calls == [(100, tuple(labels)), (101, (lucky,)), (102, (lucky,)), (101, (found["chosen"],)),
                     (102, (found["chosen"],))]
