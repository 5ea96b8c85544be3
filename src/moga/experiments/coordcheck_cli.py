"""``moga coordcheck``: the command, its report (what each drift means and what to try) and figures; the
check itself is :mod:`moga.experiments.coordcheck`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import typer

from moga.experiments.coordcheck import (
    ARMS, CONTROL, FAMILIES, LayerVerdict, Record, coordcheck, optimizer_spec)
from moga.experiments.coordcheck_plot import figure
from moga.files import save_figure, write_json
from moga.train.cli import refuse_imports


def plot(records: list[Record], path: Path, optimizer: str, depth: int | None = None) -> Path:
    """Writes :func:`moga.experiments.coordcheck_plot.figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(records, optimizer, depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path


def report(records: list[Record], found: list[LayerVerdict], out: Path | None, init: str = "default") -> str:
    if not found:
        return ""
    name_width = max(len("layer"), *(len(v.layer) for v in found))
    t = found[0].tolerance
    widths = sorted({r.width for r in records})
    lines = [f"Per layer, the slope of log RMS against log width; a part is flat when |slope| <= {t:g}. A slope s "
             f"means the value goes like width^s: over widths {widths[0]}..{widths[-1]} that is a factor "
             f"{widths[-1] / widths[0]:g}^s.",
             "  init: the layer's output at step 0, before any step (the initialization's doing);",
             "  update: its own step's effect on its output over its input's RMS, the worst step (the "
             "optimizer's doing).",
             "  A readout whose output vanishes at init is not at fault (muP's readout: the update sets its scale)."]
    init_said = False
    for optimizer in dict.fromkeys(v.optimizer for v in found):
        for depth in dict.fromkeys(v.depth for v in found if v.optimizer == optimizer):
            group = [v for v in found if v.optimizer == optimizer and v.depth == depth]
            head = f"{optimizer}" + (f" depth {depth}" if depth is not None else "")
            faults = [(part, [v.layer for v in group if part in v.verdict]) for part in ("init", "optimizer")]
            summary = "; ".join(f"{part} drifts on {len(names)} ({', '.join(names)})" for part, names in faults
                                if names) or "all layers flat"
            lines.append(f"== {head}: {summary}")
            lines.append(f"{'layer':<{name_width}}  {'role':<9}  {'init (step 0)':<20}  update (worst step)")
            lines += [v.line(name_width) for v in group]
            lines += explain(group, widths, init, init_said)
            init_said = init_said or any("init" in v.verdict for v in group)
            if out is not None:
                label = re.sub(r"[^\w.-]+", "_", optimizer)
                name = f"coordcheck_{label}" + (f"_depth{depth}" if depth is not None else "") + ".png"
                lines.append(f"figure: {plot(records, out / name, optimizer, depth)}")
    if out is not None:
        write_json(out / "coordcheck.json", {
            "records": [asdict(r) for r in records], "verdicts": [asdict(v) for v in found]})
    return "\n".join(lines)


def explain(group: list[LayerVerdict], widths: Sequence[int], init: str, init_said: bool = False) -> list[str]:
    """What a group's drift means, the worst layer's number as an example, and what to try: the init's part
    and the optimizer's part each get one line (none when all is flat). The init's part is the same under
    every optimizer: after the first group (``init_said``) it is one short line."""
    span = widths[-1] / widths[0]
    lines = []
    at_init = [v for v in group if "init" in v.verdict]
    if at_init and init_said:
        lines.append("   why init: as above (step 0 comes before any optimizer step)")
    elif at_init:
        worst = max(at_init, key=lambda v: abs(v.init))
        cause = ("the model's own initialization (such as a fixed std: nanoGPT's 0.02), not the optimizer"
                 if init == "default" else "what is left under the width-aware init (moga.models.init covers "
                 "linear, conv and embedding weights by role: check this layer's role in print(opt.plan))")
        fix = ("rerun with --init width to see the optimizer's part alone, and train with "
               "moga.models.init.width_aware_init(model) if the outputs should not change with width"
               if init == "default" else "give the layer's role the init it needs (or an override of its role)")
        lines.append(f"   why init: at step 0 {worst.layer}'s output goes like width^{worst.init:+.2f} "
                     f"(x{span ** worst.init:.2g} from width {widths[0]} to {widths[-1]}): {cause}. To try: {fix}.")
    stepped = [v for v in group if "optimizer" in v.verdict]
    if stepped:
        worst = max(stepped, key=lambda v: abs(v.update))
        size = "too large" if worst.update > 0 else "too small"
        if optimizer_spec(group[0].optimizer)[0] == CONTROL:
            fix = ("expected of the control: AdamW's step has no width factor, so its effect grows with fan_in; "
                   "moga, muon:preset=moga or adamw-scaled take the factor out")
        else:
            roles = ", ".join(dict.fromkeys(f"'{v.role}': ..." for v in stepped))
            fix = (f"confirm it over more widths and steps (--widths, --steps: {len(widths)} widths fit this slope), "
                   "and read the figure for the step that drifts; if it holds, give that role its own rate "
                   f"(lr_multipliers={{{roles}}}) or another geometry (geometries= / overrides=)")
        lines.append(f"   why optimizer: {worst.layer}'s step changes its output, per unit of input, like "
                     f"width^{worst.update:+.2f} (step {worst.update_step}): a learning rate tuned at width "
                     f"{widths[0]} is x{span ** abs(worst.update):.2g} {size} for it at width {widths[-1]}. "
                     f"To try: {fix}.")
    return lines


def _ints(text: str | None) -> list[int] | None:
    return None if not text else [int(v) for v in text.split(",")]


def coordcheck_command(
    model: str = typer.Option("residual_mlp", "--model", "-m",
                              help=f"{', '.join(FAMILIES)}, or package.module:factory taking width (and depth)"),
    optim: str = typer.Option(",".join(ARMS), "--optim",
                              help="comma-separated, each with options if any (moga:vectors=sign;p=2.5); "
                                   "adamw is the control; muon:preset=moga is the papers' all-geometry Muon "
                                   "(lr 0.02), muon the published one (lr 1e-3)"),
    widths: str = typer.Option("64,128,256,512,1024", help="comma-separated widths"),
    depths: str = typer.Option(None, help="comma-separated depths (default: the model's own)"),
    steps: int = typer.Option(5, min=1, help="optimizer steps per width"),
    lr: float = typer.Option(None, help="one learning rate for every optimizer (default: each one's own)"),
    tolerance: float = typer.Option(0.1, help="a part is flat when |slope| <= tolerance"),
    init: str = typer.Option("default", help="default: the model's own init; width: a width-aware init by "
                             "role (moga.models.init), so that what drifts is the optimizer's"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("runs/coordcheck"), "--out", "-o", help="figures and coordcheck.json go here"),
    no_import: bool = typer.Option(False, "--no-import", help="refuse a package.module:factory model (it would "
                                   "import and run code); also MOGA_NO_IMPORT=1"),
) -> None:
    """muP's coordinate check: per layer, output RMS at init and after each of a few steps, the step's
    effect and norm, against width; slopes of log RMS vs log width, and a verdict per layer that says
    whether the init or the optimizer drifts."""
    if no_import:
        refuse_imports()
    names = [o.strip() for o in optim.split(",") if o.strip()]
    lrs = {o: lr for o in names} if lr is not None else None
    try:
        records, found = coordcheck(model, names, _ints(widths), _ints(depths), steps, lrs, seed, tolerance, init,
                                    progress=lambda line: typer.echo(line, err=True))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(report(records, found, out, init))
