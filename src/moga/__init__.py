"""moga: geometry-aware optimizers whose learning rate transfers across width and depth."""

__version__ = "0.1.0"
