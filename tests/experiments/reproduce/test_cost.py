"""The cost cache behind ``moga reproduce --list``: what it serves is what the build gives, kept between calls."""

from moga.experiments.reproduce.catalog import estimate, get
from moga.experiments.reproduce.cost import cell_cost, cost_cache


def test_the_cost_cache_keeps_each_cell_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path))
    rep = get("depth-mlp")
    sweep = rep.sweep("quick")
    config = sweep.config(sweep.cells[0])
    cache = cost_cache()
    assert cell_cost(config, cache) == cell_cost(config) and cache.path.is_file()
    again = cost_cache()  # what the next call reads: the file, under the config's hash
    assert again.path == cache.path and again.costs == cache.costs and config.hash() in again.costs
    assert estimate(rep, "quick", cache=again) == estimate(rep, "quick")
    again.costs[config.hash()] = {**again.costs[config.hash()], "params": -1}
    assert cell_cost(config, again)["params"] == -1  # served from the cache, not built again
