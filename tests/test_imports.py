"""``import moga`` stays light: ``import moga`` alone loads no torch (its names load on first use), and
``from moga import MOGA`` loads no torch.distributed.tensor (nor sympy, which that pulls in, ~2 s) until a
sharded parameter exists, and adds few modules to torch's own. Counted, not timed, in a fresh process; the
budget is in docs/development.md."""

import subprocess
import sys

import moga

HEAVY = ("torch.distributed.tensor", "sympy", "torch._dynamo", "torch._inductor", "transformers", "scipy",
         "matplotlib", "typer", "rich", "pydantic")
BUDGET = 40  # modules `import moga` adds to `import torch`'s: 37 measured (moga's own 36 and sysconfig)


def test_import_moga_loads_nothing_heavy_and_stays_in_budget():
    code = ("import sys, torch; before = set(sys.modules); import moga; moga.MOGA, moga.build_plan; "
            "added = sorted(set(sys.modules) - before); print(len(added)); print(' '.join(added))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    count, added = int(out[0]), out[1].split()
    heavy = [m for m in added if m.split(".")[0] in HEAVY or any(m.startswith(h) for h in HEAVY)]
    assert not heavy, f"import moga loads {heavy}"
    assert count <= BUDGET, f"import moga adds {count} modules to torch's (budget {BUDGET}): {added}"


def test_import_moga_alone_loads_no_torch():
    code = "import sys, moga; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_plan_error_is_exported():
    assert moga.PlanError is moga.roles.PlanError and "PlanError" in moga.__all__


def test_reproduce_list_loads_no_trainer_sharding_plots_or_stats():
    """`moga reproduce --list` reads configs and cached costs: the engine's checkpoint machinery, FSDP (and the
    DTensor and sympy under both), matplotlib and scipy.stats load on first use, not for a listing (issue 37:
    under 2 s of CPU on a 2-core machine; 3 s when they loaded)."""
    code = ("import sys; from moga.cli import main; sys.argv = ['moga', 'reproduce', '--list']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sorted(sys.modules)))")
    # the first listing on a machine builds each cell's model on the meta device for its cost (HF's included) and
    # caches it; the second reads the cache
    subprocess.run([sys.executable, "-m", "moga", "reproduce", "--list"], capture_output=True, check=True)
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = loaded.strip().splitlines()[-1].split()
    heavy = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor", "sympy",
             "matplotlib", "scipy.stats", "transformers", "moga.train.engine")
    assert not [m for m in loaded if m.startswith(heavy)]
