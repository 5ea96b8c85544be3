"""`moga reproduce NAME`: every claim of the three papers as one command, with a verdict that cannot flatter.

The reproductions are data (``configs/*.yaml``, read by :mod:`.catalog`); :mod:`.run` runs one on the sweep
store (resumable, kill -9 safe) and judges the paper's claim; :mod:`.table` turns the stored outcomes into
the README's results table.
"""
