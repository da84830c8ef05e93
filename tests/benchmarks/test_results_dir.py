"""Where a bench run writes: ``--out``, or a fresh folder, never over the committed
``docs/results/`` (a ``--quick`` run from the repository root once replaced the full results).

The experiments themselves are replaced by recorders of the folder they were given: these
tests are about the destination, and take no time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pagedserve.benchmarks.memory as memory
import pagedserve.benchmarks.serving as serving
from pagedserve.benchmarks.report import results_dir
from pagedserve.cli import main


@pytest.fixture
def repo_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory is a checkout's root with committed results in docs/results/."""
    for name in ("memory", "serving"):
        (tmp_path / "docs" / "results" / name).mkdir(parents=True)
        (tmp_path / "docs" / "results" / name / f"{name}.md").write_text("committed\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def given(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders the experiments were asked to write into, in call order."""
    seen: list[Path] = []

    def record(o: Any) -> None:
        seen.append(o.out)

    monkeypatch.setattr(memory, "run_memory", record)
    monkeypatch.setattr(serving, "run_serving", record)
    return seen


@pytest.mark.parametrize("experiment", ["memory", "serving"])
def test_default_is_a_fresh_folder_outside_docs_results(
    repo_like: Path, given: list[Path], experiment: str
) -> None:
    assert main(["bench", experiment, "--quick", "--no-progress"]) == 0
    assert main(["bench", experiment, "--quick", "--no-progress"]) == 0
    first, second = (p.resolve() for p in given)
    docs = (repo_like / "docs" / "results").resolve()
    for out in (first, second):
        assert not out.is_relative_to(docs), out
        assert out.is_dir() and not any(out.iterdir()), out
        assert out.name.startswith(experiment)
    assert first != second  # two runs, even within one second, never share a folder
    assert (docs / experiment / f"{experiment}.md").read_text() == "committed\n"


@pytest.mark.parametrize("experiment", ["memory", "serving"])
def test_out_is_where_the_run_writes(
    repo_like: Path, given: list[Path], tmp_path: Path, experiment: str
) -> None:
    out = tmp_path / "elsewhere" / experiment
    assert main(["bench", experiment, "--quick", "--no-progress", "--out", str(out)]) == 0
    assert given == [out] and out.is_dir()


def test_replot_needs_the_folder_it_redraws(repo_like: Path, given: list[Path]) -> None:
    assert main(["bench", "serving", "--replot"]) == 2
    assert given == []


def test_the_helper_keeps_an_explicit_folder(tmp_path: Path) -> None:
    assert results_dir(tmp_path / "a" / "b", "memory") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
