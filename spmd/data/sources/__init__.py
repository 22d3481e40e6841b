"""Sources: the deterministic DataSources a task returns - named arrays (`arrays`), time windows of
trajectories (`windows`) and of gridded weather / climate files (`gridded_windows`), synthetic
data (`synthetic`); the padded last batch of a split (`padded_tail`) and the coordinates of
predictions (`forecast_grid`).
"""
