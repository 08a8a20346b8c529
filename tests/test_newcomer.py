"""What a new user meets first (issue U): a fast ``--help``, presets found where they were written, one-line errors
for malformed presets and missing extras, thresholds of another model refused when the cache is built."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import vismemo_hf
from vismemo_hf import presets
from vismemo_hf.cli import main
from vismemo_hf.defaults import DEFAULT_POLICY, FAMILY_NAMES


def test_help_and_version_import_no_torch():
    """``vismemo --help`` builds every parser without torch, transformers or any subsystem."""
    code = ("import sys; from vismemo_hf.cli import parser; parser().format_help(); import vismemo_hf; "
            "vismemo_hf.__version__; heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'yaml') "
            "if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_light_names_match_the_heavy_modules():
    from vismemo_hf.families import FAMILIES
    from vismemo_hf.runtime.cache import VisMemoCache

    assert tuple(FAMILIES) == FAMILY_NAMES
    assert VisMemoCache().policy.name == DEFAULT_POLICY
    assert set(vismemo_hf.__all__) <= set(dir(vismemo_hf))
    assert all(getattr(vismemo_hf, name) is not None for name in vismemo_hf.__all__)


def test_help_shows_defaults_and_what_a_command_writes(capsys):
    assert main(["calibrate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "(default: 10)" in text  # --pairs-per-kind
    assert "(default: 0)" in text  # --seed: a zero default is shown too
    assert "configs/lookup/NAME.yaml" in text and "``" not in text
    assert main(["report", "quality", "--help"]) == 0
    text = capsys.readouterr().out
    assert "default: all" in " ".join(text.split())  # --policies: what it really is


@pytest.fixture
def empty_dir(tmp_path, monkeypatch):
    """A working directory with no configs/ and a user config folder of its own."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return work


def test_presets_search_path_first_match_wins(empty_dir, tmp_path, capsys):
    shipped = presets.find("lookup", "vismemo-docqa-tiny")
    assert shipped.is_relative_to(presets.config_dir())
    user = tmp_path / "xdg" / "vismemo" / "lookup" / "vismemo-docqa-tiny.yaml"
    user.parent.mkdir(parents=True)
    user.write_text(shipped.read_text())
    assert presets.find("lookup", "vismemo-docqa-tiny") == user
    local = presets.write_path("lookup", "vismemo-docqa-tiny")
    local.parent.mkdir(parents=True)
    local.write_text(shipped.read_text())
    assert presets.find("lookup", "vismemo-docqa-tiny").resolve() == (empty_dir / local).resolve()
    assert main(["presets", "lookup"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("vismemo-docqa-tiny"))
    assert "shadows" in line and str(user) in line and str(shipped) in line
    with pytest.raises(ValueError, match="searched .*xdg"):
        presets.find("lookup", "no-such-preset")


def test_a_profile_written_here_is_found_by_name(empty_dir):
    """What ``vismemo profile-vlcache --name`` writes, ``profile=NAME`` reads, from the same directory."""
    assert main(["profile-vlcache", "--model", "tiny", "--pairs", "1", "--name", "mine"]) == 0
    assert (empty_dir / "configs" / "vlcache" / "mine.yaml").is_file()
    ratios = vismemo_hf.get_policy("vlcache", profile="mine", recompute_ratio=0.3).ratios()
    assert len(ratios) > 0 and abs(sum(ratios) / len(ratios) - 0.3) < 1e-6


@pytest.mark.parametrize("kind, use", [
    ("policies", lambda name: vismemo_hf.get_policy(name)),
    ("store", lambda name: vismemo_hf.VisMemoStore.from_config(name)),
    ("lookup", lambda name: vismemo_hf.LookupThresholds.load(name)),
])
def test_malformed_yaml_is_a_one_line_error(empty_dir, kind, use, capsys):
    path = empty_dir / "configs" / kind / "broken.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("policy: attend-deviate\n  recompute_ratio: [0.1\n")
    with pytest.raises(ValueError, match=r"broken.yaml is not valid YAML \(.* line \d+, column \d+\)") as err:
        use("broken")
    assert "\n" not in str(err.value)
    if kind == "policies":
        assert main(["demo", "--policy", "broken"]) == 2
        message = capsys.readouterr().err.strip()
        assert message.startswith("vismemo demo: error:") and "\n" not in message and "not valid YAML" in message


def test_missing_extra_is_named(empty_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.delitem(sys.modules, "vismemo_hf.bench.trace", raising=False)
    rc = main(["bench", "trace", "--requests", "20", "--capacities", "5", "--out", str(empty_dir / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "pip install 'vismemo-hf[eval]'" in err and "matplotlib" in err


@pytest.mark.parametrize("argv", [["report", "pareto"], ["bench", "soak"], ["bench", "latency"], ["report", "quality"],
                                  ["build-stream", "synthdoc"], ["bench", "store", "--remote", "redis://127.0.0.1:1/0"]])
def test_a_missing_extra_is_named_before_any_work(empty_dir, monkeypatch, capsys, argv):
    """Not after a whole sweep (report pareto wrote its JSON, then failed on the plot)."""
    for module in ("matplotlib", "matplotlib.pyplot", "redis", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)
    out = empty_dir / "out"
    assert main([*argv, "--out", str(out)] if argv[0] != "build-stream" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not installed; it comes with pip install 'vismemo-hf[" in err
    assert not out.exists() and not any(empty_dir.iterdir())


def test_thresholds_of_another_model_are_refused_when_the_cache_is_built(qwen2, tmp_path):
    from vismemo_hf.families import model_fingerprint

    model, _ = qwen2
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"tau": 0.7, "tau_fine": 0.9, "fingerprint": "0" * 32}))
    with pytest.raises(ValueError, match="calibrated for model 000000000000 given for model"):
        vismemo_hf.VisMemoCache(thresholds=str(path), model=model)
    vismemo_hf.VisMemoCache(thresholds=str(path))  # no model given: checked at the first approximate lookup
    path.write_text(yaml.safe_dump({"tau": 0.7, "tau_fine": 0.9, "fingerprint": model_fingerprint(model)}))
    assert vismemo_hf.VisMemoCache(thresholds=str(path), model=model).thresholds.tau == 0.7


def test_packaged_configs_are_package_data():
    """A wheel carries the presets (``presets.config_dir`` finds them next to the package, or in a checkout)."""
    root = Path(vismemo_hf.__file__).parent
    assert (root / "configs").is_dir() or (root.parents[1] / "configs" / "models").is_dir()


def test_train_docqa_runs_and_resumes(tmp_path, capsys):
    """Both readers' training loops (a few steps): the tiny one saves a loadable checkpoint, the base one resumes
    from its state at the step it reached."""
    import json

    from vismemo_hf.eval.docqa import docqa_model

    tiny = tmp_path / "tiny"
    assert main(["--quiet", "train-docqa", "--reader", "tiny", "--max-steps", "2", "--out", str(tiny)]) == 0
    model, _ = docqa_model(tiny)
    assert json.loads((tiny / "training.json").read_text())["step"] == 2 and model is not None
    base = tmp_path / "base"
    for steps in (1, 2):
        assert main(["--quiet", "train-docqa", "--reader", "base", "--max-steps", str(steps), "--out", str(base)]) == 0
    info = json.loads((base / "state" / "training.json").read_text())
    assert info["step"] == 2 and info["total_steps"] == 12000
    assert "step 2: latest state" in capsys.readouterr().out


def test_python_dash_m_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "vismemo_hf", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"vismemo-hf {vismemo_hf.__version__}"
