"""The README's commands from a wheel, in an empty directory: the wheel is built from this tree, installed with
``--no-deps`` into a fresh venv that sees the build environment's third-party packages (a plain path line in a
``.pth`` file: that directory's own ``.pth`` files, the editable install of vismemo_hf among them, stay out) but
not the source tree, and every command below runs there as README.md writes it, checked by what it produces
(the results JSON of lmms-eval, which exits 0 on failure), not by its exit code alone.

Deselect with ``-k 'not wheel'`` (about a minute and a half: a wheel build and an lmms-eval run).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

# The README's commands this test runs, as written there (each asserted to appear verbatim in README.md).
VERSION = "vismemo --version"
DEMO = "vismemo demo"
BUILD_STREAM = "vismemo build-stream synthdoc --seeds 0,1 --bases 20"
LMMS_EVAL = ("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lmms-eval --model vismemo \\\n"
             "    --model_args pretrained=vismemo-docqa-tiny,policy=vismemo,recompute_ratio=0.3 \\\n"
             '    --tasks vismemo_synthdoc --include_path "$(vismemo tasks-path)" --batch_size 1 --output_path out/')
#: the placeholder of the "## Use" snippet's model, replaced by the packaged reader's folder
MODEL_PLACEHOLDER = "/path/to/Qwen2.5-VL-7B-Instruct"
# Not run, they need what an empty directory on an offline machine lacks: `build-stream docvqa` (local parquet files
# under /data/docvqa, --near-model /models/Qwen2.5-VL-7B-Instruct), `build-stream infovqa` (lmms-lab/InfographicVQA
# from the HF hub or its cache), the lmms-eval runs and `vismemo calibrate` of /models/Qwen2.5-VL-7B-Instruct; the
# report commands write results/ tables of the source checkout; `make demo` / `make test` need its Makefile; the
# `pip install` lines need a package index (this test installs the wheel it built, --no-deps, instead).
# Console scripts of third-party packages the commands call: the venv gets them pointed at its own interpreter.
SCRIPTS = ("lmms-eval",)


def _in_readme(command: str) -> None:
    assert command in README, f"README.md no longer shows {command!r}: update the README or this test"


def _use_snippet() -> str:
    """The first python block of README's "## Use" section, as written."""
    section = README.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "README.md's ## Use section has no python block"
    return found.group(1)



def _source_copy(dest: Path) -> Path:
    """The files a checkout has (tracked, and untracked ones git does not ignore), copied: the wheel is built from
    them without writing build/ or egg-info into the tree other runs use."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode != 0:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                  "__pycache__", ".cache", "results", "checkpoints"))
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file() and not name.startswith(("results/", "checkpoints/", "benchmarks/", "docs/")):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(venv python, environment) of a fresh venv holding only the wheel (its dependencies: the build
    environment's site-packages, as a plain path)."""
    if importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("pip") is None:
        pytest.skip("building a wheel needs setuptools and pip in the build environment")
    from importlib.metadata import version

    setuptools = version("setuptools")  # not imported here: its distutils shim would fight pytest's
    if int(setuptools.split(".")[0]) < 77:
        pytest.skip(f"pyproject.toml needs setuptools>=77 to build (no build isolation here: offline), "
                    f"found {setuptools}")
    root = tmp_path_factory.mktemp("wheel")
    source = _source_copy(root / "source")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(root / "dist")], capture_output=True, text=True)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    wheel = next((root / "dist").glob("vismemo_hf-*.whl"))

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    build_site = sysconfig.get_paths()["purelib"]
    # a plain path line: build_site's packages importable, its .pth files (the editable vismemo_hf) not processed
    (site / "zz_build_environment.pth").write_text(build_site + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, f"pip install failed:\n{installed.stdout[-3000:]}\n{installed.stderr[-3000:]}"
    for script in SCRIPTS:
        original = Path(sysconfig.get_paths()["scripts"]) / script
        if original.exists():
            body = original.read_text().split("\n", 1)[1]
            (venv / "bin" / script).write_text(f"#!{python}\n{body}")
            (venv / "bin" / script).chmod(0o755)
    home = root / "home"
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_CONFIG_HOME": str(home / ".config"),
           "HF_HOME": str(home / ".cache" / "huggingface"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    return python, venv, env


def _empty_dir(tmp_path) -> Path:
    work = tmp_path / "empty"
    work.mkdir()
    return work


def _bash(command: str, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _said(run) -> str:
    return f"(exit {run.returncode})\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def test_the_wheel_imports_from_its_venv_not_the_source_tree(wheel_env, tmp_path):
    python, venv, env = wheel_env
    work = _empty_dir(tmp_path)
    probe = ("import importlib.metadata as m, sys, vismemo_hf, lmms_eval\n"
             "print(vismemo_hf.__file__)\n"
             "print(m.distribution('vismemo-hf').locate_file(''))\n"
             "assert not [n for n in sys.modules if n.startswith('__editable__')], 'the editable finder ran'\n"
             "print('\\n'.join(sys.path))")
    run = subprocess.run([str(python), "-c", probe], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, _said(run)
    package, dist, *path = run.stdout.splitlines()
    assert Path(package).is_relative_to(venv), package
    assert Path(dist).is_relative_to(venv), dist
    source = [p for p in path if p and (Path(p).resolve() == REPO or Path(p).resolve().is_relative_to(REPO / "src"))]
    assert not source, source
    tasks = _bash("vismemo tasks-path", work, env)
    assert tasks.returncode == 0 and Path(tasks.stdout.strip()).is_relative_to(venv), _said(tasks)
    # every kind of preset ships, the readers' context tolerance among them (found by fingerprint from any directory)
    kinds = subprocess.run([str(python), "-c", "from vismemo_hf import presets\n"
                            "for k in presets.KINDS: print(k, len(presets.available(k)))"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert kinds.returncode == 0, _said(kinds)
    counts = dict(line.split() for line in kinds.stdout.splitlines())
    assert all(int(n) > 0 for n in counts.values()) and int(counts["context"]) >= 2, counts


def test_readme_cli_commands_from_a_wheel(wheel_env, tmp_path):
    import tomllib

    python, venv, env = wheel_env
    work = _empty_dir(tmp_path)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    run = _bash(VERSION, work, env)
    assert run.stdout.strip() == f"vismemo-hf {version}", _said(run)
    run = _bash(DEMO, work, env)
    assert run.returncode == 0 and "exact" in run.stdout and "approximate" in run.stdout, _said(run)
    assert not list(work.iterdir()), list(work.iterdir())  # nothing written where they ran
    for command in (VERSION, DEMO):  # run first: that they work from a wheel shows even where the README lacks them
        _in_readme(command)


def test_readme_use_snippet_from_a_wheel(wheel_env, tmp_path):
    """The "## Use" snippet as written, on the packaged reader (for the 7B model's placeholder path) and a
    synthetic page (its ``messages``): one miss, and the page's value read."""
    python, venv, env = wheel_env
    work = _empty_dir(tmp_path)
    snippet = _use_snippet()
    assert f'"{MODEL_PLACEHOLDER}"' in snippet, snippet
    prelude = (
        "import importlib.resources\n"
        "from vismemo_hf.eval import synthdoc\n"
        "READER = str(importlib.resources.files('vismemo_hf') / 'models' / 'docqa-tiny')\n"
        "page = synthdoc.random_form(0)\n"
        "key, value = page.rows[0]\n"
        "messages = [{'role': 'user', 'content': [{'type': 'image', 'image': synthdoc.render(page)},\n"
        "                                         {'type': 'text', 'text': synthdoc.question_for(key)}]}]\n"
    )
    check = (
        f"\nassert READER.startswith({str(venv)!r}), READER\n"
        "assert [str(e.kind) for e in cache.events] == ['miss'], cache.events\n"
        "answer = processor.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True)\n"
        "assert answer.strip() == value, (answer, value)\n"
        "print('answered', answer)\n"
    )
    script = prelude + snippet.replace(f'"{MODEL_PLACEHOLDER}"', "READER") + check
    run = subprocess.run([str(python), "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "answered" in run.stdout, _said(run)


def test_readme_lmms_eval_commands_from_a_wheel(wheel_env, tmp_path):
    """The synthdoc stream, then the README's lmms-eval run on it (``--limit 3``), judged by its results JSON."""
    python, venv, env = wheel_env
    if not (venv / "bin" / "lmms-eval").exists():
        pytest.skip("lmms-eval is not installed in the build environment (pip install 'vismemo-hf[eval]')")
    work = _empty_dir(tmp_path)
    _in_readme(BUILD_STREAM)
    run = _bash(BUILD_STREAM, work, env)
    assert (work / ".cache/vismemo-data/synthdoc/test.parquet").is_file(), _said(run)
    _in_readme(LMMS_EVAL)
    run = _bash(LMMS_EVAL + " --limit 3", work, env)
    files = list((work / "out").rglob("*_results.json"))
    assert files, f"lmms-eval wrote no results {_said(run)}"
    results = json.loads(files[0].read_text())["results"]["vismemo_synthdoc"]
    anls = results.get("anls,none")
    assert isinstance(anls, (int, float)) and 0.0 <= anls <= 1.0, results
    counts = [results[f"answers_{k},none"] for k in ("miss", "exact", "approximate")]
    assert sum(counts) == 3 and counts[0] >= 1, results  # realised hit kinds of the 3 requests, the first a miss
