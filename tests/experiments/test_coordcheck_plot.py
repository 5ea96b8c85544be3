"""The coordinate check's figure: widths as ticks, one colour per layer in every panel, one legend."""

from moga.experiments.coordcheck import residual_mlp, run_one
from moga.experiments.coordcheck_plot import figure


def test_figure_ticks_are_the_widths_and_each_layer_keeps_its_colour():
    import matplotlib.colors as mcolors

    widths = (16, 32, 64)
    records = []
    for width in widths:
        records += run_one(residual_mlp(width, depth=2, seed=0), "moga", 2**-4, 2, width, None)
    fig = figure(records, "moga")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison and ax.get_lines()]
    assert len(panels) == 3 + 3 * 2  # the output at init and after each step; the other rows after each step
    colours = {}
    for ax in panels:
        assert list(ax.get_xticks()) == list(widths)
        if ax.get_xlabel():  # the lowest panel of each column labels them
            assert [t.get_text() for t in ax.get_xticklabels()] == [str(w) for w in widths]
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(mcolors.to_hex(line.get_color()))
        # every panel's y range holds at least two labelled ticks, a constant row included (the step norm)
        low, high = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if low <= t <= high]
        assert len(ticks) >= 2, (ax.get_title(), ticks)
    assert sum(bool(ax.get_xlabel()) for ax in panels) == 3  # the init column's panel and two steps'
    assert all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == len(colours)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == list(colours)
    norms = [ax for ax in panels if ax.get_title().startswith("step norm")]
    assert all(ax.get_ylim() == norms[0].get_ylim() for ax in norms)  # a row shares its y axis
