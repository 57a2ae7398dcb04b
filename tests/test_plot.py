"""Plots, per-job progress and the W&B run of real chains of the real trainer.

Two real 2-job chains run through ``auto_launch --backend local`` (2 ranks under torchrun each):
chain A with a W&B API key in the environment and WANDB_MODE=offline, chain B with another
learning rate and W&B off. A sweep made of both is registered by hand. Per-set validation losses
and WERs, and the figure's axes read back (limits, colours, labels), come from files written here
in the documented format (tests/test_results.py's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from PIL import Image

from orchestrator.dashboard import build_workspace, load_spec
from orchestrator.manifest import find_manifest, register_sweep
from orchestrator.plot import WER_COLOR, draw, figure_of, plot_data
from tests.harness.chains import launch_json
from tests.harness.process import REPO, run_tool
from tests.harness.results import make_chain, status_json, train_row, val_row, write_eval
from tests.harness.wandb_runs import base_env, of_type, wandb_records

# Built at run time: the chain runs a snapshot of this checkout, so a literal key in this file
# would be found in the run dir's copy of it, which is not a leak.
SECRET = "-".join(("secret", "xyz", "123"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Chain:
    summary: dict  # auto_launch --json
    run_dir: Path
    rows: list[dict]  # metrics.jsonl's training rows (validation rows have no loss)

    @property
    def chain_id(self) -> str:
        return self.summary["chain_id"]

    @property
    def seeds(self) -> list[int]:
        return [job["seed"] for job in self.summary["jobs"]]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plot")


def wandb_dirs(tmp: Path) -> dict[str, str]:
    """Every wandb directory under ``tmp`` (run_tool puts the venv's bin first on PATH)."""
    return {k: v for k, v in base_env(tmp).items() if k.startswith("WANDB_")}


def launch(run_dir: Path, corpus: Path, env: dict[str, str], *overrides: str) -> Chain:
    summary = launch_json(
        "-n2",
        "--backend",
        "local",
        "--run-dir",
        str(run_dir),
        "recipes/train_tiny_fsdp2.yaml",
        "--",
        f"data.corpus={corpus}",
        "train.max_steps=6",
        "train.max_steps_per_run=3",
        "data.max_duration=8",
        *overrides,
        cwd=REPO,
        env=env,
    )
    assert [job["state"] for job in summary["jobs"]] == ["COMPLETED"] * 2, summary
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return Chain(summary, run_dir, [row for row in rows if "loss" in row])


@pytest.fixture(scope="module")
def chain(tmp: Path, corpus: Path) -> Chain:
    """W&B resolves to offline from WANDB_MODE although a key is set."""
    env = {**wandb_dirs(tmp), "WANDB_API_KEY": SECRET, "WANDB_MODE": "offline"}
    return launch(tmp / "run_a", corpus, env)


@pytest.fixture(scope="module")
def sweep(tmp: Path, corpus: Path, chain: Chain) -> tuple[str, Chain, Chain]:
    other = launch(tmp / "run_b", corpus, wandb_dirs(tmp), "optim.lr=0.001", "wandb.mode=disabled")
    register_sweep(
        "sweep-plot-test",
        [
            {"chain_id": chain.chain_id, "run_dir": str(chain.run_dir), "overrides": []},
            {
                "chain_id": other.chain_id,
                "run_dir": str(other.run_dir),
                "overrides": ["optim.lr=0.001"],
            },
        ],
    )
    return "sweep-plot-test", chain, other


def read_png(path: Path) -> Image.Image:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()
        return image


def test_plot_of_a_chain(chain: Chain) -> None:
    done = run_tool("orchestrator", "plot", chain.chain_id)
    assert done.returncode == 0, done.stderr
    out = chain.run_dir / "plot.png"
    assert done.stdout.strip() == str(out)
    assert read_png(out).size == (1000, 700)

    (series,) = plot_data(chain.chain_id).series
    assert series.label == chain.chain_id
    assert series.steps == [1, 2, 3, 4, 5, 6]
    assert series.losses == [row["loss"] for row in chain.rows]
    assert series.tokens_per_s == [row["tokens_per_s"] for row in chain.rows]
    assert [(job.job_index, job.seed, job.first_step, job.last_step) for job in series.jobs] == [
        (0, chain.seeds[0], 1, 3),
        (1, chain.seeds[1], 4, 6),
    ]
    assert series.boundaries == [3.5]


def test_plot_to_a_chosen_file(chain: Chain, tmp: Path) -> None:
    out = tmp / "plots" / "a.png"
    done = run_tool("orchestrator", "plot", str(chain.run_dir), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    read_png(out)


def test_plot_of_a_sweep_overlays_its_chains(sweep: tuple[str, Chain, Chain], orch_home) -> None:
    sweep_id, first, second = sweep
    done = run_tool("orchestrator", "plot", sweep_id)
    assert done.returncode == 0, done.stderr
    out = orch_home / "sweeps" / f"{sweep_id}.png"
    assert done.stdout.strip() == str(out)
    read_png(out)

    data = plot_data(sweep_id)
    assert [s.label for s in data.series] == [first.chain_id, "optim.lr=0.001"]
    assert [s.chain_id for s in data.series] == [first.chain_id, second.chain_id]
    for series, source in zip(data.series, (first, second), strict=True):
        assert series.steps == [1, 2, 3, 4, 5, 6]
        assert series.losses == [row["loss"] for row in source.rows]
        assert [job.seed for job in series.jobs] == source.seeds
    assert data.series[0].losses != data.series[1].losses


def test_plot_without_metrics_is_a_usage_error(chain: Chain, tmp: Path) -> None:
    run_dir = tmp / "not_started"
    run_dir.mkdir()
    manifest = find_manifest(str(chain.run_dir))
    manifest.run_dir = str(run_dir)
    manifest.chain_id = "not-started"
    manifest.save()
    done = run_tool("orchestrator", "plot", str(run_dir))
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "no metrics yet" in done.stderr, done.stderr
    assert not (run_dir / "plot.png").exists()


def test_status_shows_each_jobs_last_step_and_loss(chain: Chain) -> None:
    done = run_tool("orchestrator", "status", chain.chain_id, "--json")
    assert done.returncode == 0, done.stderr
    jobs = json.loads(done.stdout)["jobs"]
    assert [(job["last_step"], job["last_loss"]) for job in jobs] == [
        (3, chain.rows[2]["loss"]),
        (6, chain.rows[5]["loss"]),
    ]

    table = run_tool("orchestrator", "status", chain.chain_id).stdout.splitlines()
    assert table[1].startswith("latest: val_loss ")
    header = table[2].split()
    assert header[:6] == ["index", "job_id", "seed", "state", "step", "loss"]
    for line, row in zip(table[3:], (chain.rows[2], chain.rows[5]), strict=True):
        assert line.split()[4:6] == [str(row["step"]), f"{row['loss']:.4f}"]
    assert "  code: " in table[0]  # what the jobs ran: the commit, from where


def test_wandb_run_is_one_continuous_run_per_chain(chain: Chain, tmp: Path) -> None:
    run_files = sorted((chain.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, run_files  # one offline-run dir per job, sharing the run id
    records = [record for path in run_files for record in wandb_records(path, tmp)]

    runs = of_type(records, "run")
    assert len({run["run_id"] for run in runs}) == 1
    assert {run["run_group"] for run in runs} == {chain.chain_id}

    history = of_type(records, "history")
    assert [row["step"]["num"] for row in history] == [1, 2, 3, 4, 5, 6]
    for row, logged in zip(history, chain.rows, strict=True):
        assert row["item"]["loss"] == pytest.approx(logged["loss"])
        assert row["item"]["job_index"] == logged["job_index"]
        assert row["item"]["seed"] == logged["seed"]

    config: dict = {}
    for update in of_type(records, "config") + [run["config"] for run in runs]:
        config.update(update.get("update", {}))
    for index, job in enumerate(chain.summary["jobs"]):
        assert config[f"jobs/{index}/seed"] == job["seed"]
        assert config[f"jobs/{index}/slurm_job_id"] == job["job_id"]


def test_no_secret_in_any_file(chain: Chain, tmp: Path) -> None:
    files = [
        p for p in [*chain.run_dir.rglob("*"), *(tmp / "wandb_home").rglob("*")] if p.is_file()
    ]
    assert len(files) > 10, files
    leaks = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaks, f"the API key was written to {leaks}"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb-workspaces' pydantic v1 style
def test_dashboard_spec_builds_a_workspace_offline() -> None:
    spec = load_spec()
    workspace = build_workspace(spec, entity="my-team", project="speechlm", name="chains")
    panels = {
        panel.title: list(panel.y) for section in workspace.sections for panel in section.panels
    }
    wanted = ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "job_index", "seed"]
    assert sorted(y for ys in panels.values() for y in ys) == sorted(wanted)
    assert [metric.name for metric in workspace.runset_settings.groupby] == ["Group"]
    view = workspace._to_model()  # the payload save() would send, made without a server
    assert view.entity == "my-team" and view.project == "speechlm"
    assert view.display_name == "chains"
    grouping = view.spec.section.run_sets[0].grouping
    assert [(key.section, key.name) for key in grouping] == [("run", "group")]


def with_sets(row: dict, losses: dict[str, float]) -> dict:
    """A validation row of several sets, as the trainer writes it: the pooled ``val_loss``, the
    comma-joined ``val_split`` and ``val_loss/<set>`` for each."""
    per_set = {f"val_loss/{name}": loss for name, loss in losses.items()}
    return {**row, "val_split": ",".join(losses), **per_set}


def write_sets_eval(run_dir: Path, step: int, wers: dict[str, float]) -> None:
    """An evaluation of several test sets: the pooled figures at the top, each set's under
    ``sets`` (as train.evaluate writes it)."""
    write_eval(run_dir, step, sum(wers.values()) / len(wers))
    path = run_dir / "eval" / f"step_{step}" / "summary.json"
    summary = json.loads(path.read_text())
    summary["split"] = ",".join(wers)
    summary["sets"] = {name: {"wer": wer, "num_utterances": 32} for name, wer in wers.items()}
    path.write_text(json.dumps(summary))


def test_status_and_plot_show_each_validation_and_test_set(tmp_path: Path) -> None:
    """A run validated on two sets (eval.sets) and evaluated on two (train.evaluate sets=):
    status names each set's latest val_loss and WER, plot draws a line per set."""
    chain_id = "sets-chain"
    rows = [
        train_row(chain_id, 1, 0, 4.0),
        with_sets(val_row(chain_id, 1, 0, 3.0), {"clean": 2.5, "noisy": 3.5}),
        train_row(chain_id, 2, 0, 3.0),
        with_sets(val_row(chain_id, 2, 0, 2.0), {"clean": 1.5, "noisy": 2.5}),
    ]
    run_dir = make_chain(tmp_path, chain_id, rows)
    write_sets_eval(run_dir, 1, {"clean": 0.5, "other": 0.75})
    write_sets_eval(run_dir, 2, {"clean": 0.25, "other": 0.5})

    status = status_json(chain_id)
    assert status["validation"]["split"] == "clean,noisy"
    assert status["validation"]["sets"] == {"clean": 1.5, "noisy": 2.5}
    assert status["evaluation"]["wer"] == 0.375
    assert status["evaluation"]["sets"] == {"clean": 0.25, "other": 0.5}
    text = run_tool("orchestrator", "status", str(run_dir)).stdout.splitlines()
    assert text[1].startswith("latest: val_loss 2.0000 at step 2 (clean,noisy); WER 37.50%")
    assert [line.split() for line in text[2:6]] == [
        ["set", "val_loss", "wer"],
        ["clean", "1.5000", "25.00%"],
        ["noisy", "2.5000", "-"],
        ["other", "-", "50.00%"],
    ]
    assert text[6].split()[:3] == ["index", "job_id", "seed"]

    (series,) = plot_data(chain_id).series
    assert series.val_losses == [3.0, 2.0]
    assert {name: (s.steps, s.values) for name, s in series.val_sets.items()} == {
        "clean": ([1, 2], [2.5, 1.5]),
        "noisy": ([1, 2], [3.5, 2.5]),
    }
    assert {name: (s.steps, s.values) for name, s in series.wer_sets.items()} == {
        "clean": ([1, 2], [0.5, 0.25]),
        "other": ([1, 2], [0.75, 0.5]),
    }
    out = draw(plot_data(chain_id), tmp_path / "sets.png")
    assert read_png(out).size == (1000, 700)


def falling_loss(chain_id: str) -> list[dict]:
    """Three jobs of 10 steps whose loss falls from 5.4 to 2.6, less than a decade, as in the
    demo's chain: the highest point is the first, under job 0's label."""
    return [train_row(chain_id, step, (step - 1) // 10, 5.5 * 0.975**step) for step in range(1, 31)]


def drawn(data_name: str) -> tuple[Figure, dict[str, Axes]]:
    """The figure of ``data_name``, laid out and drawn as a PNG would be, and its axes by y
    label."""
    figure = figure_of(plot_data(data_name))
    FigureCanvasAgg(figure).draw()
    return figure, {axes.get_ylabel(): axes for axes in figure.axes}


def line(axes: Axes, label: str) -> Line2D:
    """The one line of ``axes`` labelled ``label``."""
    (found,) = [line for line in axes.get_lines() if line.get_label() == label]
    return found


def test_plot_reads_at_a_glance(tmp_path: Path) -> None:
    """The demo's chain as the plot found it (issue 40): a 644% WER on its own axis from 0, in a
    colour of its own, square-marked and in the legend; plain numbers on the log loss axis; the
    job labels above every point of both curves."""
    chain_id = "glance-chain"
    run_dir = make_chain(tmp_path, chain_id, falling_loss(chain_id))
    write_eval(run_dir, 30, 6.4465)
    figure, axes = drawn(chain_id)
    assert list(axes) == ["loss", "tokens/s", "WER %"]
    loss_axes, wer_axes = axes["loss"], axes["WER %"]

    loss = line(loss_axes, f"{chain_id} loss")
    wer = line(wer_axes, f"{chain_id}: WER 644.65% (step 30)")
    assert list(wer.get_xdata()) == [30] and list(wer.get_ydata()) == [pytest.approx(644.65)]
    assert wer.get_marker() == "s"
    assert to_rgba(wer.get_color()) == to_rgba(WER_COLOR) != to_rgba(loss.get_color())
    assert to_rgba(wer_axes.yaxis.label.get_color()) == to_rgba(WER_COLOR)
    assert {to_rgba(label.get_color()) for label in wer_axes.get_yticklabels()} == {
        to_rgba(WER_COLOR)
    }
    bottom, top = wer_axes.get_ylim()
    assert bottom == 0 and top > 644.65

    legend = wer_axes.get_legend()  # on the top axes: no WER point is drawn over it
    assert [text.get_text() for text in legend.get_texts()] == [loss.get_label(), wer.get_label()]
    assert [to_rgba(handle.get_color()) for handle in legend.legend_handles] == [
        to_rgba(loss.get_color()),
        to_rgba(WER_COLOR),
    ]

    ticks = loss_axes.get_yticklabels() + loss_axes.get_yticklabels(minor=True)
    shown = [float(text) for tick in ticks if (text := tick.get_text())]  # no 5x10^0
    low, high = loss_axes.get_ylim()
    assert len([value for value in shown if low <= value <= high]) >= 2, shown
    assert all(float(tick.get_text()) >= 0 for tick in wer_axes.get_yticklabels())

    renderer = figure.canvas.get_renderer()
    labels = [text for text in loss_axes.texts if text.get_text().startswith("job ")]
    assert [label.get_text() for label in labels] == [
        f"job {index}\nseed {10 + index}" for index in (0, 1, 2)
    ]
    under_labels = min(label.get_window_extent(renderer).y0 for label in labels)
    for axes_of, curve in ((loss_axes, loss), (wer_axes, wer)):
        points = axes_of.transData.transform(np.column_stack(curve.get_data()))
        assert points[:, 1].max() < under_labels, axes_of.get_ylabel()


def test_a_sweeps_wer_keeps_each_members_colour(tmp_path: Path) -> None:
    """Overlaid chains tell their WERs apart by the member's colour, on one WER axis from 0."""
    members = []
    for index, wer in enumerate((0.3, 0.6)):
        chain_id = f"glance-sweep-{index}"
        run_dir = make_chain(tmp_path, chain_id, falling_loss(chain_id))
        write_eval(run_dir, 30, wer)
        members.append(
            {"chain_id": chain_id, "run_dir": str(run_dir), "overrides": [f"lr={index}"]}
        )
    register_sweep("glance-sweep", members)
    _, axes = drawn("glance-sweep")
    wer_axes = axes["WER %"]
    for index, wer in enumerate((30.0, 60.0)):
        loss = line(axes["loss"], f"lr={index} loss")
        member_wer = line(wer_axes, f"lr={index}: WER {wer:.2f}% (step 30)")
        assert to_rgba(member_wer.get_color()) == to_rgba(loss.get_color()) == to_rgba(f"C{index}")
    assert wer_axes.get_ylim()[0] == 0
