"""moga inside the trainers people already use: Hugging Face (``moga.integrations.hf``) and Lightning.

moga's optimizers are plain ``torch.optim.Optimizer`` subclasses whose ``state_dict`` survives
``torch.save`` / ``torch.load(weights_only=True)``, so Trainer, Accelerate and Lightning checkpoint and
resume them like any torch optimizer. Lightning needs no helper: return ``MOGA(self)`` (or
``MOGA(self.model)``) from ``configure_optimizers``.
"""
