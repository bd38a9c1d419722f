"""PNG plots of a finished stage's main curves (pipeline.stage_metrics), drawn from the
metric history its MLflow run holds: one image, one panel per curve, logged to the run as
`plots/<stage>.png`. Done here, after the stage, for every kind alike."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from pipeline.stage_metrics import kind_metrics

_PANEL_INCHES = (4.0, 2.8)
_COLUMNS = 3


def history(client, run_id: str, names: list[str]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values) from the run, in step order, finite values only."""
    out = {}
    for name in names:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name)
                        if math.isfinite(m.value))
        if points:
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def render(title: str, curves: dict[str, tuple[list[int], list[float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib.figure import Figure

    columns = min(_COLUMNS, len(curves))
    rows = math.ceil(len(curves) / columns)
    fig = Figure(figsize=(_PANEL_INCHES[0] * columns, _PANEL_INCHES[1] * rows + 0.5), layout="constrained")
    fig.suptitle(title)
    for i, (name, (steps, values)) in enumerate(curves.items(), 1):
        ax = fig.add_subplot(rows, columns, i)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return path


def log_main_curves(client, run_id: str, kind: str, stage: str) -> str | None:
    """Plot the kind's main curves that the run logged; the artifact path, or None when the
    kind declares none or the run logged none of them."""
    declared = kind_metrics(kind).curves
    if not declared:
        return None
    logged = client.get_run(run_id).data.metrics.keys()
    found = {c.name: c.find(logged) for c in declared}
    curves = history(client, run_id, [n for n in found.values() if n])
    if not curves:
        return None
    # each panel is titled with the grouped name, whatever name the stage logged it under
    titled = {c: curves[n] for c, n in found.items() if n in curves}
    with tempfile.TemporaryDirectory() as tmp:
        png = render(f"{stage} ({kind})", titled, Path(tmp) / f"{stage}.png")
        client.log_artifact(run_id, str(png), "plots")
    return f"plots/{stage}.png"
