"""`moga tune`: tune the learning rate on small proxies of a target model, with the regret it will cost there.

>>> from moga.experiments.tune import tune
>>> result = tune("configs/train/shakespeare_char_gpt.yaml", width=512, depth=8, budget_flops=1e15, out="runs/tune")
>>> result["rate"], result["prediction"]["regret_interval"], result["snippets"]["torchrun"]
"""

from moga.experiments.tune.knobs import TuneError
from moga.experiments.tune.run import tune

__all__ = ["TuneError", "tune"]
