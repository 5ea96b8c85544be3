"""The papers' experiments, built on the library: the demo, the smoothness experiments, reproductions.

Nothing below this package imports it; it sits above ``sweep`` and ``smoothness`` and below ``cli``.
"""
