"""`moga smoothness EXPERIMENT`: the papers' smoothness and convergence claims measured at CPU scale."""
